"""The memory report (gpumem.report) and the live timeline recorder (gpumem.timeline), without a GPU."""
from __future__ import annotations

import html
import pathlib
import re
import sys
import time

import pytest

from gpumem import _C
from gpumem.monitoring import timeline
from gpumem.settings import devices as _devices
from gpumem.trace import replay
from gpumem.monitoring import reporting as report
from gpumem.monitoring.reporting import Report

MiB, GiB = 1 << 20, 1 << 30
DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture
def sim():
    """A 1 GiB simulated device capped at 256 MiB, with live blocks and a freed hole."""
    allocator = _C.SimAllocator(GiB)
    allocator.set_limit(0, "256MB")
    for size in (30 * MiB, 300 * 1024, 12 * MiB + 5):
        allocator.malloc(0, size)
    allocator.free(allocator.malloc(0, 3 * MiB))
    return allocator


def text_rows(text: str) -> dict[str, list[str]]:
    """The text table's rows as {label: [current, peak]} (values like "3.51 GiB")."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"^  (\S.*?)\s{2,}(\S+(?: \S+)?)(?:\s{2,}(\S+ \S+))?$", line)
        if match:
            rows[match.group(1)] = [v for v in match.groups()[1:] if v]
    return rows


def html_rows(markup: str) -> dict[str, list[str]]:
    rows = {}
    for label, cells in re.findall(r"<tr><th[^>]*>([^<]+)</th>(.*?)</tr>", markup):
        rows[html.unescape(label)] = [html.unescape(c) for c in re.findall(r"<td[^>]*>([^<]*)</td>", cells)]
    return rows


def bar_width(markup: str, name: str) -> float:
    return float(re.search(rf'class="gpumem-{name}"[^>]*width:([0-9.]+)%', markup).group(1))


def stats(**values) -> dict:
    return {key.replace("__", "."): value for key, value in values.items()}


# ---- text ---------------------------------------------------------------------------------------


def test_text_report_shows_the_allocators_numbers(sim):
    rows = text_rows(str(Report.from_sim(sim, 1, total=GiB)))
    numbers = sim.stats(0)
    assert rows["allocated"] == [_C.format_bytes(numbers["allocated_bytes.all.current"]),
                                 _C.format_bytes(numbers["allocated_bytes.all.peak"])]
    assert rows["reserved"] == [_C.format_bytes(numbers["reserved_bytes.all.current"]),
                                _C.format_bytes(numbers["reserved_bytes.all.peak"])]
    assert rows["inactive split"][0] == _C.format_bytes(numbers["inactive_split_bytes.all.current"])
    assert rows["limit"] == ["256.00 MiB"]
    assert rows["largest free block"] == [_C.format_bytes(sim.largest_free_block(0))]
    assert rows["device free"] == [_C.format_bytes(GiB - sim.reserved(0))]


@pytest.mark.parametrize("page_size, kind", [(0, "plain"), (2 * MiB, "growable")])
def test_text_report_states_the_segment_kind_in_effect(page_size, kind):
    sim = _C.SimAllocator(GiB, page_size=page_size)
    assert text_rows(str(Report.from_sim(sim, 1, total=GiB)))["segments"] == [kind]


def test_a_report_shows_what_paused_regions_gave_back_and_snapshots_mark_their_segments():
    sim = _C.SimAllocator(GiB, page_size=2 * MiB)
    assert "paused" not in text_rows(str(Report.from_sim(sim, 1, total=GiB)))
    sim.region_create(0, 1)
    sim.region_begin(0, 1)
    sim.malloc(0, 100 * MiB)
    sim.region_end(0, 1)
    kept = sim.malloc(0, 10 * MiB)  # the default pool's
    assert not any(s["paused"] for s in sim.snapshot(0))
    paused = sim.region_pause(0, 1, False)
    assert text_rows(str(Report.from_sim(sim, 1, total=GiB)))["paused"] == [_C.format_bytes(paused)]
    marked = {s["pool"]: s["paused"] for s in sim.snapshot(0)}
    assert marked == {(1 << 62, 1): True, (0, 0): False}
    sim.region_resume(0, 1)
    assert not any(s["paused"] for s in sim.snapshot(0))
    sim.free(kept)


def test_a_report_without_a_segment_kind_leaves_the_row_out():
    assert "segments" not in text_rows(str(Report.from_stats({0: {"stats": {}}})))


def test_html_report_states_the_segment_kind():
    sim = _C.SimAllocator(GiB, page_size=2 * MiB)
    assert html_rows(Report.from_sim(sim, 1, total=GiB)._repr_html_())["segments"] == ["growable", ""]


def test_a_replays_report_states_the_segments_it_used():
    for kind in ("growable", "plain"):
        made = replay.replay(DATA / "two_devices.pickle", "none", segments=kind).report()
        assert made.devices[0].segments == kind


def test_text_report_shows_the_counters():
    counters = stats(num_ooms=3, num_alloc_retries=5, num_cache_releases=7)
    rows = text_rows(str(Report.from_stats({0: {"stats": counters}})))
    assert (rows["OOMs"], rows["alloc retries"], rows["cache releases"]) == (["3"], ["5"], ["7"])


def test_text_report_aligns_its_columns(sim):
    lines = [line for line in str(Report.from_sim(sim, 1, total=GiB)).splitlines() if "iB" in line]
    current_ends = {line.index("iB") + 2 for line in lines}
    assert len(current_ends) == 1


def test_repr_is_the_text_table(sim):
    made = Report.from_sim(sim, 1)
    assert repr(made) == str(made)


def test_outside_estimate_is_device_used_minus_reserved():
    made = Report.from_stats({0: {"stats": stats(reserved_bytes__all__current=3 * GiB),
                                  "total": 80 * GiB, "free": 76 * GiB}})
    assert made.devices[0].outside_estimate == GiB
    assert text_rows(str(made))["outside PyTorch*"] == ["1.00 GiB"]
    assert "* estimate: device used (total - free) minus reserved" in str(made)


def test_outside_estimate_is_unknown_without_the_devices_memory():
    made = Report.from_stats([{"stats": {}}])
    assert made.devices[0].outside_estimate is None
    assert text_rows(str(made))["outside PyTorch*"] == ["unknown"]


def test_report_without_devices_says_none_was_found():
    assert "no CUDA device was found" in str(Report([]))
    assert "no CUDA device was found" in Report([])._repr_html_()


def test_from_stats_needs_a_stats_dict():
    with pytest.raises(ValueError, match="device 2 have no 'stats'"):
        Report.from_stats({2: {"limit": 1}})


# ---- HTML ---------------------------------------------------------------------------------------


def test_html_report_holds_the_allocators_numbers(sim):
    rows = html_rows(Report.from_sim(sim, 1, total=GiB)._repr_html_())
    numbers = sim.stats(0)
    assert rows["allocated"] == [_C.format_bytes(numbers["allocated_bytes.all.current"]),
                                 _C.format_bytes(numbers["allocated_bytes.all.peak"])]
    assert rows["reserved"] == [_C.format_bytes(numbers["reserved_bytes.all.current"]),
                                _C.format_bytes(numbers["reserved_bytes.all.peak"])]
    assert rows["limit"] == ["256.00 MiB", ""]
    assert rows["largest free block"] == [_C.format_bytes(sim.largest_free_block(0)), ""]


def test_html_bar_widths_are_shares_of_the_limit():
    numbers = stats(allocated_bytes__all__current=GiB, reserved_bytes__all__current=3 * GiB)
    made = Report.from_stats({0: {"stats": numbers, "limit": 4 * GiB}})
    markup = made._repr_html_()
    assert bar_width(markup, "reserved") == 75.0
    assert bar_width(markup, "allocated") == 25.0
    assert 'title="limit 4.00 GiB"' in markup and 'title="allocated 1.00 GiB"' in markup


def test_html_allocated_bar_is_nested_inside_the_reserved_bar(sim):
    markup = Report.from_sim(sim, 1)._repr_html_()
    nested = r'class="gpumem-limit".*?class="gpumem-reserved".*?class="gpumem-allocated"[^>]*></div></div></div>'
    assert re.search(nested, markup)


def test_html_report_is_self_contained(sim):
    markup = Report.from_sim(sim, 1)._repr_html_().lower()
    assert not any(needle in markup for needle in ("<script", "<link", "<style", "http:", "https:", "@import"))


# ---- plots --------------------------------------------------------------------------------------


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    replay.replay(str(DATA / "train_like.pickle"), "400MB").report().plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        Report.from_stats([{"stats": {}, "timeline": [(0.0, 1, 2)]}]).plot()


def test_plot_without_a_timeline_says_how_to_record_one():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match=r"no timeline to plot; record one with gpumem.timeline.start\(\)"):
        Report.from_stats([{"stats": {}}]).plot()


# ---- live collection ----------------------------------------------------------------------------


def test_collect_reads_every_device_of_gpumems_allocator(fake_c, monkeypatch):
    monkeypatch.setattr(fake_c, "largest_free_block", lambda d: fake_c.sims[d].largest_free_block(0), raising=False)
    fake_c.set_limit(1, "1GB")
    fake_c.malloc(1, 100 * MiB)
    made = report.collect()
    assert [d.device for d in made.devices] == [0, 1]
    second = made.devices[1]
    assert (second.limit, second.allocated, second.total) == (GiB, 100 * MiB, 8 * GiB)
    assert second.free == 8 * GiB - fake_c.sims[1].reserved(0)


def test_collect_states_each_devices_segment_kind(fake_c, monkeypatch):
    monkeypatch.setattr(fake_c, "largest_free_block", lambda d: 0, raising=False)
    fake_c.set_growable(1, False)
    assert [d.segments for d in report.collect().devices] == ["growable", "plain"]


def test_collect_reads_one_device_when_asked(fake_c, monkeypatch):
    monkeypatch.setattr(fake_c, "largest_free_block", lambda d: 0, raising=False)
    assert [d.device for d in report.collect(1).devices] == [1]


# ---- the timeline recorder ----------------------------------------------------------------------


class CountingC:
    """Statistics that grow by 1 MiB at each read."""

    def __init__(self):
        self.reads = 0

    def device_count(self) -> int:
        return 1

    def stats(self, device: int) -> dict:
        self.reads += 1
        return {"allocated_bytes.all.current": self.reads * MiB, "reserved_bytes.all.current": 2 * self.reads * MiB}


@pytest.fixture
def counting_c(monkeypatch):
    fake = CountingC()
    use_timeline_c(monkeypatch, fake)
    yield fake
    timeline.stop()


def use_timeline_c(monkeypatch, fake) -> None:
    """The timeline reads statistics from `fake`, and checks devices against its count."""
    monkeypatch.setattr(timeline, "_C", fake)
    monkeypatch.setattr(_devices, "_C", fake)
    monkeypatch.setattr(timeline, "_recorder", None)


def wait_for(condition, seconds: float = 60.0) -> None:  # ends once it holds; the bound is for a loaded machine
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_timeline_is_off_until_started(counting_c):
    assert not timeline.is_recording() and timeline.points(0) == [] and counting_c.reads == 0


def test_timeline_records_time_allocated_and_reserved(counting_c):
    timeline.start(interval_s=0.001)
    wait_for(lambda: len(timeline.points(0)) >= 3)
    timeline.stop()
    points = timeline.points(0)
    assert len(points) >= 3 and not timeline.is_recording()
    assert [t for t, _, _ in points] == sorted(t for t, _, _ in points)
    assert all(reserved == 2 * allocated for _, allocated, reserved in points)


def test_timeline_stays_bounded_by_thinning_its_points(counting_c):
    timeline.start(interval_s=0.0005, max_points=8)
    wait_for(lambda: counting_c.reads >= 24)
    timeline.stop()
    assert counting_c.reads >= 24
    assert len(timeline.points(0)) < 8


def test_timeline_refuses_a_second_start(counting_c):
    timeline.start(interval_s=0.01)
    with pytest.raises(RuntimeError, match="already recording"):
        timeline.start()


def test_timeline_without_a_device_says_so(monkeypatch):
    use_timeline_c(monkeypatch, type("NoDevice", (), {"device_count": lambda self: 0})())
    with pytest.raises(RuntimeError, match="no CUDA device"):
        timeline.start()


class TwoDevicesC(CountingC):
    def device_count(self) -> int:
        return 2


@pytest.mark.parametrize("devices, error, needle", [
    ([5], ValueError, "there is no CUDA device 5; this process sees devices 0..1"),
    ([0, -1], ValueError, "there is no CUDA device -1"),
    (["cuda:7"], ValueError, "there is no CUDA device 7"),
    (["cpu"], ValueError, "'cpu' is not a CUDA device"),
    ([1.5], TypeError, "device 1.5 (float) is not an index"),
    ([True], TypeError, "device True is a bool"),
    ("01", TypeError, "timeline devices '01' is not a list of devices"),
    (3, TypeError, "timeline devices 3 is not a list of devices"),
    ([], ValueError, "timeline devices is empty"),
], ids=["absent", "negative", "cuda:7", "cpu", "float", "bool", "str", "int", "empty"])
def test_timeline_refuses_bad_devices_before_it_starts(monkeypatch, devices, error, needle):
    use_timeline_c(monkeypatch, TwoDevicesC())
    with pytest.raises(error) as caught:
        timeline.start(devices=devices)
    assert needle in str(caught.value)
    assert not timeline.is_recording()


def test_timeline_records_the_devices_named(monkeypatch):
    use_timeline_c(monkeypatch, TwoDevicesC())
    timeline.start(interval_s=0.001, devices=["cuda:1", 1])
    wait_for(lambda: len(timeline.points(1)) >= 2)
    timeline.stop()
    assert timeline.points(1) and timeline.points(0) == []


@pytest.mark.parametrize("interval_s, max_points, error", [
    (0, 10, ValueError), (float("inf"), 10, ValueError), (0.01, 1, ValueError),
    ("fast", 10, TypeError), (0.01, 2.5, TypeError), (True, 10, TypeError),
])
def test_timeline_refuses_bad_settings_naming_them(counting_c, interval_s, max_points, error):
    with pytest.raises(error, match="gpumem: timeline"):
        timeline.start(interval_s=interval_s, max_points=max_points)
    assert not timeline.is_recording()


class FailingC(CountingC):
    """Statistics that can be read twice, then fail, as a device lost mid-run would."""

    def stats(self, device: int) -> dict:
        if self.reads == 2:
            raise RuntimeError("CUDA error: device lost")
        return super().stats(device)


def test_timeline_stops_on_an_error_keeping_its_points_and_saying_why(monkeypatch):
    use_timeline_c(monkeypatch, FailingC())
    failures = []
    monkeypatch.setattr("threading.excepthook", failures.append)  # a thread that dies would land here
    timeline.start(interval_s=0.001)
    wait_for(lambda: not timeline.is_recording())
    assert not timeline.is_recording() and failures == []
    assert len(timeline.points(0)) == 2
    assert timeline.error() == "RuntimeError: CUDA error: device lost"
    with pytest.warns(RuntimeWarning, match="timeline stopped recording early: RuntimeError: CUDA error: device lost"):
        timeline.stop()


def test_timeline_error_is_none_while_all_is_well(counting_c):
    timeline.start(interval_s=0.001)
    wait_for(lambda: len(timeline.points(0)) >= 2)
    timeline.stop()
    assert timeline.error() is None


# ---- plot advice fits the report ----------------------------------------------------------------


def test_plot_of_a_simulated_device_without_a_timeline_gives_replay_advice():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError) as caught:
        Report.from_stats([{"stats": {}, "simulated": True}]).plot()
    assert "replay" in str(caught.value) and "timeline.start" not in str(caught.value)


def test_plot_after_the_timeline_failed_says_why_it_has_no_points(monkeypatch):
    pytest.importorskip("matplotlib")
    fake = FailingC()
    fake.reads = 2  # fails at the first read
    use_timeline_c(monkeypatch, fake)
    timeline.start(interval_s=0.001)
    wait_for(lambda: not timeline.is_recording())
    with pytest.raises(ValueError, match=r"the timeline stopped recording on an error \(RuntimeError: CUDA error"):
        Report.from_stats([{"stats": {}}]).plot()
    with pytest.warns(RuntimeWarning):
        timeline.stop()
