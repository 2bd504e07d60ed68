"""A limit on the whole process: set_limit(scope=...), get_scope and GPUMEM_SCOPE over fake devices
(fake_c.py), and what the simulated device shows of it through the metrics, the published figures
and `gpumem top`. No GPU needed; tests/python/test_gpu_process_scope.py runs it on one."""
import pytest

import gpumem
from gpumem import _C
from gpumem.monitoring import metrics, publish, published
from gpumem.settings import environment

MiB, GiB = 1 << 20, 1 << 30


def test_the_default_scope_is_the_allocator(fake_c):
    gpumem.set_limit("4GB")
    assert [gpumem.get_scope(d) for d in (0, 1)] == ["allocator", "allocator"]


def test_the_process_scope_counts_what_the_process_holds_outside_gpumem(fake_c):
    fake_c.sims[0].set_use_outside(0, 1 * GiB)
    gpumem.set_limit("2GB", scope="process")
    assert gpumem.get_scope(0) == "process"
    with pytest.raises(MemoryError, match="on the whole process, of which 1024.00 MiB is held outside"):
        fake_c.malloc(0, 1100 * 1000 * 1000)  # fits 2 GB alone, not beside the 1 GiB outside
    fake_c.malloc(0, 900 * 1000 * 1000)


def test_a_scope_on_one_device_leaves_the_other(fake_c):
    gpumem.set_limit("2GB", device=1, scope="process")
    assert [gpumem.get_scope(d) for d in (0, 1)] == ["allocator", "process"]


def test_set_limit_without_a_scope_keeps_the_scope_in_effect(fake_c):
    gpumem.set_limit("2GB", scope="process")
    gpumem.set_limit("3GB")
    assert gpumem.get_scope(0) == "process"
    gpumem.set_limit("3GB", scope=" Allocator ")
    assert gpumem.get_scope(0) == "allocator"


@pytest.mark.parametrize("scope", ["", "proc", "whole", "process,allocator"])
def test_a_bad_scope_is_refused_naming_it_and_the_forms_and_changes_nothing(fake_c, scope):
    with pytest.raises(ValueError) as caught:
        gpumem.set_limit("1GB", scope=scope)
    assert f"limit scope {scope!r}" in str(caught.value)
    assert '"allocator" or "process"' in str(caught.value)
    assert not fake_c.installed
    assert fake_c.limits() == [8 * GiB, 8 * GiB]


@pytest.mark.parametrize("scope", [1, True, ["process"]])
def test_a_scope_of_the_wrong_type_is_a_type_error(fake_c, scope):
    with pytest.raises(TypeError, match='give "allocator" or "process"'):
        gpumem.set_limit("1GB", scope=scope)
    assert not fake_c.installed


@pytest.mark.parametrize("value, scope", [("process", "process"), (" ALLOCATOR", "allocator")])
def test_gpumem_scope_is_read_as_a_scope(value, scope):
    assert environment.scope({"GPUMEM_SCOPE": value}) == scope


def test_a_bad_gpumem_scope_names_the_variable_its_value_and_the_forms():
    with pytest.raises(ValueError) as caught:
        environment.scope({"GPUMEM_SCOPE": "node"})
    assert "GPUMEM_SCOPE='node'" in str(caught.value) and '"allocator" or "process"' in str(caught.value)


def test_gpumem_scope_applies_when_the_devices_are_first_used(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_SCOPE", "process")
    monkeypatch.setenv("GPUMEM_LIMIT", "2GB")
    gpumem.enable()
    assert fake_c.install_scope == "process"
    assert [gpumem.get_scope(d) for d in (0, 1)] == ["process", "process"]


def test_a_bad_gpumem_scope_leaves_gpumem_uninstalled(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_SCOPE", "everything")
    with pytest.raises(ValueError, match="GPUMEM_SCOPE"):
        gpumem.enable()
    assert not fake_c.installed


def test_the_hook_checks_gpumem_scope_with_the_other_settings():
    assert ("GPUMEM_SCOPE", environment.scope) in environment.SETTINGS


# ---- what monitoring shows ----------------------------------------------------------------------


def process_scoped_sim(outside: int) -> _C.SimAllocator:
    sim = _C.SimAllocator(8 * GiB)
    sim.set_use_outside(0, outside)
    sim.set_limit(0, "4GiB")
    sim.set_scope(0, "process")
    sim.malloc(0, 1 * GiB)
    return sim


def labelled_samples(sim) -> list:
    return list(metrics._device_samples(sim.device_figures(0)))


def samples(sim) -> dict:
    return {name: value for name, value, _ in labelled_samples(sim)}


def test_metrics_count_the_memory_outside_under_the_process_scope():
    sim = process_scoped_sim(1536 * MiB)
    labelled = labelled_samples(sim)
    figures = {name: value for name, value, _ in labelled}
    assert figures["gpumem_process_outside_bytes"] == 1536 * MiB
    [labels] = [extra for name, _, extra in labelled if name == "gpumem_process_outside_bytes"]
    assert labels == ("process accounting",)
    assert figures["gpumem_counted_bytes"] == figures["gpumem_reserved_bytes"] + 1536 * MiB
    assert figures["gpumem_free_under_limit_bytes"] == 4 * GiB - figures["gpumem_counted_bytes"]


def test_metrics_under_the_allocator_scope_count_reserved_alone():
    sim = _C.SimAllocator(8 * GiB)
    sim.set_use_outside(0, 1536 * MiB)
    sim.set_limit(0, "4GiB")
    sim.malloc(0, 1 * GiB)
    figures = samples(sim)
    assert "gpumem_process_outside_bytes" not in figures
    assert figures["gpumem_counted_bytes"] == figures["gpumem_reserved_bytes"]


def test_published_figures_carry_the_scope_and_what_is_outside():
    sim = process_scoped_sim(1536 * MiB)
    [device] = publish.device_figures(sim, lambda d: {"uuid": None, "device_total": 8 * GiB})
    assert device["scope"] == "process" and device["outside"] == 1536 * MiB
    assert published._checked_device(device) == device


def test_a_published_file_without_a_scope_reads_as_the_allocator_scope():
    sim = process_scoped_sim(0)
    [device] = publish.device_figures(sim, lambda d: {"uuid": None, "device_total": 8 * GiB})
    del device["scope"], device["outside"]
    checked = published._checked_device(device)
    assert checked["scope"] == "allocator" and checked["outside"] == 0


@pytest.mark.parametrize("scope, outside", [("node", 0), ("process", -1), ("process", "1GB")])
def test_a_published_file_with_a_bad_scope_or_outside_is_refused(scope, outside):
    sim = process_scoped_sim(0)
    [device] = publish.device_figures(sim, lambda d: {"uuid": None, "device_total": 8 * GiB})
    device.update(scope=scope, outside=outside)
    with pytest.raises(ValueError):
        published._checked_device(device)


def test_the_report_says_the_limit_is_on_the_whole_process_and_what_it_counts_outside():
    from gpumem.monitoring.reporting import Report

    text = str(Report.from_sim(process_scoped_sim(1536 * MiB), total=8 * GiB))
    assert "  limit, whole process     4.00 GiB\n" in text
    assert "  outside gpumem, counted  1.50 GiB  process accounting\n" in text
    sim = _C.SimAllocator(8 * GiB)
    sim.malloc(0, 1 * GiB)
    assert "whole process" not in str(Report.from_sim(sim, total=8 * GiB))
