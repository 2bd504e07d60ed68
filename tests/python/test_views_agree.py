"""Every view of a device's memory shows the same figures (gpumem.monitoring.figures, Note [which reserved]):
the report, the statistics (gpumem.stats, what torch.cuda.memory_stats maps one to one), the
Prometheus metrics and `gpumem top --json` give the same reserved and allocated, each equal to what
the device handed gpumem, and no peak is below its current value, in every mode: caching off,
growable segments, plain segments, and a limit on the whole process (whose counted figure,
reserved plus the memory outside gpumem, has a name and a peak of its own)."""
from __future__ import annotations

import os

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpumem import _C
from gpumem.monitoring import metrics, publish
from gpumem.monitoring.reporting import Report

from test_report import text_rows
from test_top import UUID, gpu, identity, json_of, run_dir  # noqa: F401 - fixtures

MiB, GiB = 1 << 20, 1 << 30
MODES = ("caching off", "growable", "plain", "scope=process")


class Device:
    """A simulated device in `mode`, driven through a big request, its free, a peak reset and a
    smaller request, so that every peak has both moved and been reset."""

    def __init__(self, mode: str):
        self.mode = mode
        self.sim = _C.SimAllocator(16 * GiB, page_size=2 * MiB if mode == "growable" else 0)
        self.sim.set_growable(0, mode == "growable")
        self.sim.set_limit_bytes(0, 8 * GiB)
        if mode == "scope=process":
            self.sim.set_use_outside(0, 256 * MiB)
            self.sim.set_scope(0, "process")

    def malloc(self, size: int) -> int:
        return self.sim.malloc_uncached(0, size) if self.mode == "caching off" else self.sim.malloc(0, size)

    def free(self, addr: int):
        if self.mode == "caching off":
            self.sim.free_uncached(0, addr)
        else:
            self.sim.free(addr)

    def drive(self, step: int):
        """Step 0: 1 GiB held. 1: 2 GiB held then 1 GiB freed. 2: the peaks reset, then (under a
        limit on the whole process) more memory outside gpumem, and 256 MiB more."""
        if step == 0:
            self.malloc(GiB)
        elif step == 1:
            self.free(self.malloc(GiB))
        else:
            self.sim.reset_peak_stats(0)
            if self.mode == "scope=process":
                self.sim.set_use_outside(0, 768 * MiB)
            self.malloc(256 * MiB)


def scraped(sim) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.Collector(sim, job="test"))
    text = generate_latest(registry).decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples}


_publishers = {}  # one a device: a process publishes one file, rewritten at each step


def top_figures(sim, run_dir, monkeypatch, capsys) -> dict:  # noqa: F811
    key = (id(sim), run_dir.path)
    if key not in _publishers:
        _publishers[key] = (sim, publish.Publisher(run_dir, source=sim, identity=identity(),
                                                   uuid_of=lambda device: UUID))
    assert _publishers[key][1].step()
    document = json_of(run_dir, gpu(0, processes={os.getpid(): 12 * GiB}), monkeypatch=monkeypatch, capsys=capsys)
    [process] = [p for p in document["processes"] if p["pid"] == os.getpid()]
    return process["gpumem"]


def views(sim, run_dir, monkeypatch, capsys) -> dict:  # noqa: F811
    """{view: {figure: bytes}} for reserved, allocated and their peaks."""
    stats = sim.stats(0)
    rows = text_rows(str(Report.from_sim(sim, 1)))
    sizes = {"reserved": rows["reserved"], "allocated": rows["allocated"]}
    report = {f"{name}{suffix}": text for name, (now, peak) in sizes.items()
              for suffix, text in (("", now), ("_peak", peak))}
    samples = scraped(sim)
    top = top_figures(sim, run_dir, monkeypatch, capsys)
    names = ("reserved", "reserved_peak", "allocated", "allocated_peak")
    return {
        "stats": {name: stats[f"{name.split('_')[0]}_bytes.all.{'peak' if name.endswith('peak') else 'current'}"]
                  for name in names},
        "metrics": {name: samples[f"gpumem_{name}_bytes"] for name in names},
        "top": {name: top[f"{name}_bytes"] for name in names},
        "report": report,  # as the report prints them
    }


@pytest.mark.parametrize("mode", MODES)
def test_every_view_shows_the_reserved_and_allocated_the_device_handed_out(mode, run_dir, monkeypatch, capsys):  # noqa: F811
    device = Device(mode)
    for step in range(3):
        device.drive(step)
        seen = views(device.sim, run_dir, monkeypatch, capsys)
        numbers = seen.pop("report")
        in_use = device.sim.ledger(0)["in_use"]  # what the device handed gpumem
        assert seen["stats"]["reserved"] == in_use == device.sim.reserved(0), (mode, step)
        for view, figures in seen.items():
            assert figures == seen["stats"], (mode, step, view)
        assert numbers == {name: _C.format_bytes(value) for name, value in seen["stats"].items()}, (mode, step)


@pytest.mark.parametrize("mode", MODES)
def test_no_view_shows_a_peak_below_its_current_value(mode, run_dir, monkeypatch, capsys):  # noqa: F811
    device = Device(mode)
    for step in range(3):
        device.drive(step)
        for view, figures in views(device.sim, run_dir, monkeypatch, capsys).items():
            if view == "report":
                continue
            for name in ("reserved", "allocated"):
                assert figures[f"{name}_peak"] >= figures[name], (mode, step, view, name, figures)


@pytest.mark.parametrize("mode", MODES)
def test_what_the_limit_counts_has_its_own_name_and_peak_in_the_metrics_and_top(mode, run_dir, monkeypatch,
                                                                                capsys):  # noqa: F811
    device = Device(mode)
    for step in range(3):
        device.drive(step)
        figures = device.sim.device_figures(0)
        counted = figures["stats"]["reserved_bytes.all.current"] + figures["outside"]
        samples = scraped(device.sim)
        top = top_figures(device.sim, run_dir, monkeypatch, capsys)
        assert samples["gpumem_counted_bytes"] == top["counted_bytes"] == counted, (mode, step)
        assert samples["gpumem_counted_peak_bytes"] == top["counted_peak_bytes"] >= counted, (mode, step)
        if mode == "scope=process":
            assert figures["outside"] >= 256 * MiB and counted > figures["stats"]["reserved_bytes.all.current"]
        else:
            assert counted == figures["stats"]["reserved_bytes.all.current"]
