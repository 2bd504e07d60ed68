"""Alerts at a share of the cap (gpumem.pressure): crossings counted by the allocator on a simulated
device, callbacks called by a watcher outside it, GPUMEM_WARN_AT as a logged warning."""
from __future__ import annotations

import logging
import math
import os
import threading

import pytest

import gpumem
from gpumem import _C
from gpumem.monitoring import pressure
from gpumem.settings import environment

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def sim():
    """A 1 GiB simulated device capped at 100 MiB."""
    allocator = _C.SimAllocator(1 * GiB)
    allocator.set_limit_bytes(0, 100 * MiB)
    return allocator


@pytest.fixture
def polled(sim):
    """A watcher over `sim` that the test polls itself (no thread), and the calls it made."""
    calls = []
    watcher = pressure.Watcher(sim, poll_seconds=None)
    watcher.add(0.5, lambda *args: calls.append(args))
    return watcher, calls


@pytest.fixture
def process_watcher(monkeypatch):
    """gpumem.on_pressure's watcher made afresh, polled by the test (no thread)."""
    monkeypatch.setattr(pressure, "_process_watcher", None)
    monkeypatch.setattr(pressure, "POLL_SECONDS", None)
    return lambda: pressure._watcher()


def test_a_callback_runs_once_reserved_passes_the_share(sim, polled):
    watcher, calls = polled
    a = sim.malloc(0, 40 * MiB)
    assert watcher.poll() == 0
    b = sim.malloc(0, 20 * MiB)
    assert watcher.poll() == 1
    assert calls == [(0, sim.reserved(0), 100 * MiB)]
    sim.free(a)
    sim.free(b)


def test_a_job_hovering_above_the_share_is_told_once(sim, polled):
    watcher, calls = polled
    sim.malloc(0, 60 * MiB)
    watcher.poll()
    more = sim.malloc(0, 30 * MiB)  # a new segment, still above the share
    sim.free(more)
    for _ in range(3):  # cached: reserved does not grow
        sim.free(sim.malloc(0, 30 * MiB))
    watcher.poll()
    assert len(calls) == 1
    assert sim.ledger(0)["reserves"] == 2


def test_the_share_rearms_once_reserved_falls_to_five_points_under_it(sim, polled):
    watcher, calls = polled
    a = sim.malloc(0, 60 * MiB)
    watcher.poll()
    sim.free(a)
    sim.empty_cache(0)  # reserved 0: at most 45% of the limit
    sim.malloc(0, 60 * MiB)
    watcher.poll()
    assert len(calls) == 2


def test_falling_short_of_the_rearm_mark_does_not_rearm(sim, polled):
    watcher, calls = polled
    small = sim.malloc(0, 46 * MiB)  # 46 MiB stays: above 45% of the limit
    big = sim.malloc(0, 10 * MiB)
    watcher.poll()
    sim.free(big)
    sim.empty_cache(0)
    assert sim.reserved(0) > 45 * MiB
    sim.malloc(0, 10 * MiB)
    watcher.poll()
    assert len(calls) == 1
    sim.free(small)


def test_crossings_between_two_polls_make_one_call_and_count_each(sim, polled):
    watcher, calls = polled
    for _ in range(2):
        sim.free(sim.malloc(0, 60 * MiB))
        sim.empty_cache(0)
    assert watcher.poll() == 1
    [(device, share, crossings, _, limit)] = sim.pressure_crossings()
    assert (device, share, crossings, limit) == (0, 0.5, 2, 100 * MiB)


def test_each_callback_of_a_share_is_called(sim, polled):
    watcher, calls = polled
    more = []
    watcher.add(0.5, lambda *args: more.append(args))
    sim.malloc(0, 60 * MiB)
    watcher.poll()
    assert len(calls) == len(more) == 1


def test_a_share_watched_while_already_passed_is_reported_at_once(sim):
    sim.malloc(0, 60 * MiB)
    calls = []
    watcher = pressure.Watcher(sim, poll_seconds=None)
    watcher.add(0.5, lambda *args: calls.append(args))
    watcher.poll()
    assert len(calls) == 1


def test_a_callback_that_raises_is_logged_once_and_the_others_still_run(sim, polled, caplog):
    watcher, calls = polled

    def broken(device, reserved, limit):
        raise RuntimeError("the callback's own bug")

    watcher.add(0.5, broken)
    for _ in range(2):
        sim.free(sim.malloc(0, 60 * MiB))
        sim.empty_cache(0)
        watcher.poll()
    assert len(calls) == 2
    logged = [r for r in caplog.records if r.name == "gpumem" and "raised" in r.getMessage()]
    assert len(logged) == 1
    assert "broken" in logged[0].getMessage()
    assert str(logged[0].exc_info[1]) == "the callback's own bug"


@pytest.mark.parametrize("share", [0, 0.0, -0.1, 1.01, math.nan, math.inf])
def test_a_share_outside_zero_to_one_is_a_value_error_that_changes_nothing(sim, share):
    watcher = pressure.Watcher(sim, poll_seconds=None)
    with pytest.raises(ValueError, match=r"share .* give a share of the limit in \(0, 1\], such as 0.85"):
        watcher.add(share, print)
    sim.malloc(0, 1 * MiB)
    assert sim.pressure_crossings() == []


@pytest.mark.parametrize("share", ["0.5", True, None, [0.5]])
def test_a_share_that_is_not_a_number_is_a_type_error(sim, share):
    watcher = pressure.Watcher(sim, poll_seconds=None)
    with pytest.raises(TypeError, match="is not a number; give a share of the limit"):
        watcher.add(share, print)


def test_a_callback_that_cannot_be_called_is_a_type_error_that_changes_nothing(sim):
    watcher = pressure.Watcher(sim, poll_seconds=None)
    with pytest.raises(TypeError, match=r"callback 'print' \(str\) is not callable; give a function of"):
        watcher.add(0.5, "print")
    sim.malloc(0, 1 * MiB)
    assert sim.pressure_crossings() == []


def test_one_share_more_than_the_allocator_watches_is_a_value_error_that_changes_nothing(sim):
    watcher = pressure.Watcher(sim, poll_seconds=None)
    shares = [(i + 1) / 10 for i in range(_C.MAX_PRESSURE_SHARES)]
    for share in shares:
        watcher.add(share, print)
    with pytest.raises(ValueError, match="at most 8 different shares"):
        watcher.add(0.95, print)
    sim.malloc(0, 1 * MiB)
    assert [share for _, share, *_ in sim.pressure_crossings()] == shares


def test_the_watchers_thread_calls_the_callback(sim):
    called = threading.Event()
    watcher = pressure.Watcher(sim, poll_seconds=0.01)
    watcher.add(0.5, lambda *args: called.set())
    sim.malloc(0, 60 * MiB)
    try:
        assert called.wait(timeout=60)
        assert watcher._thread.daemon
    finally:
        watcher.close()


def test_the_watchers_thread_goes_on_after_a_callback_raises(sim):
    first, second = threading.Event(), threading.Event()

    def flaky(device, reserved, limit):
        if not first.is_set():
            first.set()
            raise RuntimeError("first call fails")
        second.set()

    watcher = pressure.Watcher(sim, poll_seconds=0.01)
    watcher.add(0.5, flaky)
    try:
        sim.free(sim.malloc(0, 60 * MiB))
        assert first.wait(timeout=60)  # reported before the next crossing, so not merged with it
        sim.empty_cache(0)
        sim.malloc(0, 60 * MiB)
        assert second.wait(timeout=60)
    finally:
        watcher.close()


# ---- gpumem.on_pressure and GPUMEM_WARN_AT over the fake compiled layer -------------------------


def test_a_forked_child_starts_with_no_callbacks(fake_c, process_watcher):
    gpumem.on_pressure(0.5, print)
    pid = os.fork()
    if pid == 0:
        watcher = pressure._process_watcher
        os._exit(0 if watcher._callbacks == {} and watcher._thread is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pressure._process_watcher._callbacks == {0.5: [print]}


def test_on_pressure_watches_every_device_those_not_used_yet_included(fake_c, process_watcher):
    calls = []
    gpumem.on_pressure(0.5, lambda *args: calls.append(args))
    assert fake_c.device_count_calls == 0  # nothing asked of the devices
    fake_c.set_limit_bytes(1, 1 * GiB)
    fake_c.malloc(1, 600 * MiB)
    process_watcher().poll()
    assert [(device, limit) for device, _, limit in calls] == [(1, 1 * GiB)]


def test_a_bad_share_from_on_pressure_names_the_value(fake_c, process_watcher):
    with pytest.raises(ValueError, match=r"bad pressure share 1.5: give a share of the limit in \(0, 1\]"):
        gpumem.on_pressure(1.5, print)


def test_warn_at_logs_a_warning_at_each_crossing(fake_c, process_watcher, caplog):
    pressure.warn_at(0.85)
    fake_c.set_limit_bytes(0, 1 * GiB)
    fake_c.malloc(0, 900 * MiB)
    with caplog.at_level(logging.WARNING, logger="gpumem"):
        process_watcher().poll()
    [record] = [r for r in caplog.records if r.name == "gpumem"]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert message.startswith("gpumem: device 0 has 900.00 MiB reserved, 88% of its limit of 1.00 GiB")
    assert "(GPUMEM_WARN_AT=0.85)" in message
    assert "fallen to 80% of the limit or below" in message


@pytest.mark.parametrize("text, share", [("0.85", 0.85), (" 1 ", 1.0), ("1e-1", 0.1)])
def test_gpumem_warn_at_reads_a_share(text, share):
    assert environment.warn_at({"GPUMEM_WARN_AT": text}) == share


@pytest.mark.parametrize("text", ["", "85%", "0", "1.5", "nan", "-0.5", "high", "0.8" * 40])
def test_a_bad_gpumem_warn_at_names_the_variable_and_the_accepted_forms(text):
    expected = r"GPUMEM_WARN_AT=.* cannot be applied: give a share of the limit in \(0, 1\]"
    with pytest.raises(ValueError, match=expected):
        environment.warn_at({"GPUMEM_WARN_AT": text})


def test_gpumem_warn_at_unset_is_none():
    assert environment.warn_at({}) is None


def test_a_bad_gpumem_warn_at_at_autoload_stops_the_program(hook_devices, stopped, monkeypatch):
    hook_devices("4GB")
    monkeypatch.setenv("GPUMEM_WARN_AT", "85%")
    line = stopped()
    assert line.startswith('gpumem: bad GPUMEM_WARN_AT "85%": give a share of the limit in (0, 1], such as 0.85.')
    assert "fix GPUMEM_WARN_AT or unset it" in line


def test_gpumem_warn_at_at_autoload_watches_the_share(hook_devices, process_watcher, monkeypatch, caplog):
    from gpumem import _autoload

    fake = hook_devices("1GB")
    monkeypatch.setenv("GPUMEM_WARN_AT", "0.5")
    _autoload.install()
    assert _autoload.state == "installed"
    fake.malloc(0, 600 * MiB)
    with caplog.at_level(logging.WARNING, logger="gpumem"):
        process_watcher().poll()
    assert any("(GPUMEM_WARN_AT=0.5)" in r.getMessage() for r in caplog.records)
