"""The least chunk of growable memory: GPUMEM_CHUNK and set_segments(chunk=...), over fake devices
(fake_c.py) that map 2 MiB pages; the autoload hook stops a program whose GPUMEM_CHUNK is bad."""
import pytest

import gpumem
from gpumem.settings import chunk, environment

MiB = 1 << 20


@pytest.mark.parametrize("value, nbytes", [("16MB", 16 * MiB), ("16 MiB", 16 * MiB), ("2m", 2 * MiB), ("0", 0),
                                           (" 512K ", 512 << 10), ("16777216", 16 * MiB), (32 * MiB, 32 * MiB),
                                           ("256MB", 256 * MiB)])
def test_a_chunk_is_a_size_or_a_byte_count(value, nbytes):
    assert chunk.chunk_bytes(value) == nbytes


@pytest.mark.parametrize("value", ["", "16GB", "1.5MB", "-1", "sixteen", "16 MB MB", "257MB", "50%", 1 << 30, -1])
def test_a_bad_chunk_is_an_error_naming_the_value_and_the_forms(value):
    with pytest.raises(ValueError) as caught:
        chunk.chunk_bytes(value)
    assert str(value) in str(caught.value) and "from 0 (pages, the default) to 256 MB" in str(caught.value)


@pytest.mark.parametrize("value", [1.5, True, None, [16]])
def test_a_chunk_of_another_type_is_a_type_error(value):
    with pytest.raises(TypeError, match="neither a size nor a byte count"):
        chunk.chunk_bytes(value)


def test_gpumem_chunk_is_read_and_unset_means_the_default():
    assert environment.chunk({"GPUMEM_CHUNK": "16MB"}) == 16 * MiB
    assert environment.chunk({}) is None


def test_a_bad_gpumem_chunk_names_the_variable_its_value_and_the_forms():
    with pytest.raises(environment.SettingError) as caught:
        environment.chunk({"GPUMEM_CHUNK": "16GB"})
    assert "GPUMEM_CHUNK='16GB'" in str(caught.value) and "256 MB" in str(caught.value)


def test_the_default_chunk_is_a_page(fake_c):
    gpumem.enable()
    assert [gpumem.get_chunk(d) for d in (0, 1)] == [2 * MiB, 2 * MiB]


def test_gpumem_chunk_applies_to_every_device_at_enable(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_CHUNK", "16MB")
    gpumem.enable()
    assert [gpumem.get_chunk(d) for d in (0, 1)] == [16 * MiB, 16 * MiB]


def test_a_chunk_is_the_least_power_of_two_pages_at_least_the_one_asked(fake_c):
    gpumem.set_segments("growable", chunk="20MB")
    assert gpumem.get_chunk(0) == 32 * MiB


def test_set_segments_sets_the_chunk_of_one_device(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_CHUNK", "16MB")
    gpumem.set_segments("growable", device=1, chunk=0)
    assert [gpumem.get_chunk(d) for d in (0, 1)] == [16 * MiB, 2 * MiB]


def test_set_segments_with_a_bad_chunk_changes_nothing(fake_c):
    gpumem.set_segments("growable", chunk="16MB")
    with pytest.raises(ValueError, match="bad chunk 'big'"):
        gpumem.set_segments("plain", chunk="big")
    assert gpumem.get_segments(0) == "growable" and gpumem.get_chunk(0) == 16 * MiB


def test_new_growable_memory_is_mapped_in_the_chunk(fake_c):
    gpumem.set_segments("growable", chunk="16MB")
    fake_c.malloc(0, 5 * MiB)
    assert fake_c.sims[0].reserved(0) == 16 * MiB
