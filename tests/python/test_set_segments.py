"""gpumem.set_segments and gpumem.get_segments, over fake devices (fake_c.py): no GPU needed."""
import pytest
import torch

import gpumem
from fake_c import GiB, FakeC, use_fake_c

MiB = 1 << 20


def expandable(fake: FakeC, device: int, address: int) -> bool:
    """Whether the fake device's segment holding `address` is growable."""
    sim = fake.sims[device]
    [segment] = [s for s in sim.snapshot(0) if s["address"] <= address < s["address"] + s["size"]]
    return segment["is_expandable"]


def test_growable_segments_are_in_effect_by_default_where_the_device_maps_pages(fake_c):
    assert gpumem.get_segments() == "growable"
    assert gpumem.get_segments(1) == "growable"


def test_plain_segments_are_in_effect_where_the_device_cannot_map_pages(monkeypatch):
    use_fake_c(monkeypatch, FakeC([8 * GiB], page_sizes=[0]))
    assert gpumem.get_segments() == "plain"


def test_set_segments_applies_to_every_device(fake_c):
    gpumem.set_segments("plain")
    assert fake_c.segments() == [False, False]
    assert [gpumem.get_segments(d) for d in (0, 1)] == ["plain", "plain"]


@pytest.mark.parametrize("device", [1, "cuda:1", torch.device("cuda", 1)])
def test_set_segments_on_one_device_leaves_the_others(fake_c, device):
    gpumem.set_segments("plain", device=device)
    assert fake_c.segments() == [True, False]


def test_set_segments_can_switch_back(fake_c):
    gpumem.set_segments("plain")
    gpumem.set_segments("growable")
    assert fake_c.segments() == [True, True]


@pytest.mark.parametrize("kind, growable", [("PLAIN", False), (" growable ", True), ("Plain", False)])
def test_a_kind_is_read_in_any_case_with_blanks_around(fake_c, kind, growable):
    gpumem.set_segments(kind)
    assert fake_c.segments() == [growable, growable]


def test_set_segments_installs_gpumem_once(fake_c):
    gpumem.set_segments("plain")
    gpumem.set_segments("growable", device=0)
    assert fake_c.installed and fake_c.install_calls == 1


def test_new_memory_comes_from_the_kind_in_effect(fake_c):
    gpumem.set_segments("plain", device=0)
    assert not expandable(fake_c, 0, fake_c.malloc(0, 8 * MiB))
    assert expandable(fake_c, 1, fake_c.malloc(1, 8 * MiB))


def test_memory_already_reserved_keeps_its_kind(fake_c):
    address = fake_c.malloc(0, 8 * MiB)
    gpumem.set_segments("plain")
    assert expandable(fake_c, 0, address)


@pytest.mark.parametrize("kind", ["grow", "plane", "", "cudaMalloc", "expandable_segments:True"])
def test_a_bad_kind_is_refused_naming_it_and_the_forms_and_changes_nothing(fake_c, kind):
    with pytest.raises(ValueError) as caught:
        gpumem.set_segments(kind)
    message = str(caught.value)
    assert repr(kind) in message
    assert '"growable" or "plain"' in message
    assert not fake_c.installed
    assert fake_c.segments() == [True, True]


@pytest.mark.parametrize("kind", [True, None, 1, b"plain"])
def test_a_kind_of_the_wrong_type_is_a_type_error_naming_the_forms(fake_c, kind):
    with pytest.raises(TypeError) as caught:
        gpumem.set_segments(kind)
    assert repr(kind) in str(caught.value) and '"growable" or "plain"' in str(caught.value)
    assert not fake_c.installed


@pytest.mark.parametrize("device, index", [(2, 2), ("cuda:7", 7)])
def test_a_device_that_does_not_exist_is_refused_and_changes_nothing(fake_c, device, index):
    with pytest.raises(ValueError, match=f"no CUDA device {index};"):
        gpumem.set_segments("plain", device=device)
    assert not fake_c.installed
    assert fake_c.segments() == [True, True]


def test_set_segments_after_pytorch_initialized_cuda_says_how_to_fix_it_and_changes_nothing(fake_c, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialized CUDA"):
        gpumem.set_segments("plain")
    assert not fake_c.installed
    assert fake_c.segments() == [True, True]


def test_set_segments_after_cuda_started_under_gpumem_is_allowed(fake_c, monkeypatch):
    gpumem.enable()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    gpumem.set_segments("plain", device="cuda")
    assert fake_c.segments() == [True, False]
    assert gpumem.get_segments() == "plain"


def test_get_segments_reads_the_current_device_without_starting_cuda(fake_c, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("CUDA would start"))
    gpumem.set_segments("plain", device=0)
    assert gpumem.get_segments() == "plain"


def test_asking_for_growable_segments_where_a_device_cannot_map_pages_warns_and_keeps_plain(monkeypatch):
    fake = FakeC([8 * GiB, 8 * GiB], page_sizes=[2 * MiB, 0])
    use_fake_c(monkeypatch, fake)
    with pytest.warns(RuntimeWarning, match=r"device\(s\) 1 cannot map memory pages"):
        gpumem.set_segments("growable")
    assert [gpumem.get_segments(d) for d in (0, 1)] == ["growable", "plain"]


def test_asking_for_plain_segments_never_warns(monkeypatch, recwarn):
    use_fake_c(monkeypatch, FakeC([8 * GiB], page_sizes=[0]))
    gpumem.set_segments("plain")
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
