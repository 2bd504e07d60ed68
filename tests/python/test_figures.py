"""The figures users see (gpumem.monitoring.figures) are one list: the metrics, the file published for
`gpumem top` and top's JSON each show every figure meant for them, and read it the same way."""
from __future__ import annotations

import os

from gpumem import _C
from gpumem.monitoring import figures as _figures, metrics, publish
from gpumem.monitoring import published as reading

from test_top import UUID, gpu, identity, json_of, run_dir  # noqa: F401 - fixtures

GiB = 1 << 30


class CachingOffSource:
    """A device holding memory handed out while caching is off besides a segment (core/uncached.h)."""

    def __init__(self):
        self.sim = _C.SimAllocator(8 * GiB)
        self.sim.set_growable(0, False)
        self.sim.malloc(0, 1 * GiB)
        self.uncached = 512 << 20
        self.sim.malloc_uncached(0, self.uncached)

    def existing_devices(self):
        return self.sim.existing_devices()

    def device_figures(self, device, device_memory=True):
        return self.sim.device_figures(device, device_memory)

    def pressure_crossings(self):
        return []

    def device_total(self, device):
        return 8 * GiB


def published_device(run_dir, source) -> dict:  # noqa: F811 - the fixture's value
    publisher = publish.Publisher(run_dir, source=source, identity=identity(), uuid_of=lambda device: UUID)
    assert publisher.step()
    [entry], problems = reading.read_entries(run_dir.path)
    assert problems == []
    [device] = entry.devices
    return device


def test_every_figure_is_a_metric():
    source = CachingOffSource()
    sampled = {name for name, _, _ in metrics._device_samples(source.device_figures(0))}
    described = {figure.metric for figure in metrics.METRICS}
    assert {figure.metric for figure in _figures.FIGURES} <= described
    assert sampled <= described


def test_every_published_figure_is_written_read_back_and_in_tops_json(run_dir, monkeypatch, capsys):  # noqa: F811
    device = published_device(run_dir, CachingOffSource())
    assert {figure.key for figure in _figures.PUBLISHED} <= set(device)
    document = json_of(run_dir, gpu(0, processes={os.getpid(): 2 * GiB}), monkeypatch=monkeypatch, capsys=capsys)
    [process] = [p for p in document["processes"] if p["pid"] == os.getpid()]
    assert {figure.document for figure in _figures.PUBLISHED} <= set(process["gpumem"])


def test_metrics_and_top_agree_on_reserved_with_memory_handed_out_while_caching_is_off(
        run_dir, monkeypatch, capsys):  # noqa: F811
    source = CachingOffSource()
    figures = source.device_figures(0)
    # Reserved is one figure (Note [which reserved]): the statistics count the uncached memory too.
    assert figures["reserved"] == figures["stats"]["reserved_bytes.all.current"] == 1 * GiB + source.uncached
    assert figures["counted"] == figures["reserved"]  # what the limit is checked against, under the allocator scope
    scraped = {name: value for name, value, _ in metrics._device_samples(figures)}
    device = published_device(run_dir, source)
    document = json_of(run_dir, gpu(0, processes={os.getpid(): 2 * GiB}), monkeypatch=monkeypatch, capsys=capsys)
    [process] = [p for p in document["processes"] if p["pid"] == os.getpid()]
    assert scraped["gpumem_reserved_bytes"] == device["reserved"] == process["gpumem"]["reserved_bytes"]
    assert device["reserved"] == figures["reserved"]
    assert scraped["gpumem_reserved_peak_bytes"] == device["reserved_peak"] >= device["reserved"]


def test_a_published_file_must_hold_every_figure_that_has_no_default(run_dir):  # noqa: F811
    device = published_device(run_dir, CachingOffSource())
    for figure in _figures.PUBLISHED:
        if figure.default is None and figure.older is None:
            incomplete = {key: value for key, value in device.items() if key != figure.key}
            try:
                reading._checked_device(incomplete)
            except ValueError as error:
                assert figure.key in str(error)
            else:
                raise AssertionError(f"a file without {figure.key} was read")


def test_an_older_file_without_the_counted_figures_reads_them_as_reserved_plus_outside(run_dir):  # noqa: F811
    device = published_device(run_dir, CachingOffSource())
    older = {key: value for key, value in device.items() if key not in ("counted", "counted_peak")}
    older["outside"] = 3 << 20
    checked = reading._checked_device(older)
    assert checked["counted"] == device["reserved"] + (3 << 20)
    assert checked["counted_peak"] == device["reserved_peak"] + (3 << 20)
    assert [figure.key for figure in _figures.PUBLISHED if figure.older] == ["counted", "counted_peak"]
