"""Reading memory snapshots and replaying them under a limit (gpumem.snapshot_file, gpumem.replay).

The synthetic snapshots in data/ come from tools/make_test_snapshots.py, whose model of an
allocator also wrote the figures they should produce to data/expected.json. The real ones
(gpt_adamw, resnet_sgd) come from tools/capture_snapshots.py on a GPU with PyTorch's own
allocator, which wrote what PyTorch reported while recording to data/captured.json.
"""
from __future__ import annotations

import json
import os
import pathlib
import pickle

import pytest

from gpumem import _C
from gpumem.trace import replay as rp
from gpumem.trace.snapshot_file import SnapshotError, from_dict, load

DATA = pathlib.Path(__file__).parent / "data"
EXPECTED = json.loads((DATA / "expected.json").read_text())
CAPTURED = json.loads((DATA / "captured.json").read_text()) if (DATA / "captured.json").exists() else {}
real_runs = pytest.mark.parametrize("name", sorted(CAPTURED))
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def data(name: str) -> str:
    return str(DATA / f"{name}.pickle")


def event(action: str, addr: int, size: int, stream: int = 0, **extra) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, **extra}


def trace(*events: dict, segments: tuple = (), **top) -> dict:
    """A snapshot dict with one device's trace; events get time_us 100, 200, ... unless given."""
    timed = [{"time_us": 100 * (i + 1), **e} for i, e in enumerate(events)]
    return {"segments": list(segments), "device_traces": [timed], **top}


def write_pickle(tmp_path, value, name="snapshot.pickle") -> str:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(value))
    return str(path)


class MakesMarker:
    """Unpickling this with a plain pickle.load would create the marker directory."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


# ---- reading ------------------------------------------------------------------------------------


def test_reader_accepts_a_synthetic_snapshot():
    snapshot = load(data("train_like"))
    assert snapshot.devices() == [0]
    assert len(snapshot.events(0)) == len(pickle.loads((DATA / "train_like.pickle").read_bytes())["device_traces"][0])
    assert snapshot.segments and all(s.device == 0 for s in snapshot.segments)
    assert snapshot.device_totals == {0: 16 * GiB}


def test_reader_reports_a_missing_file_by_name(tmp_path):
    missing = tmp_path / "nowhere.pickle"
    with pytest.raises(SnapshotError, match="no such file") as caught:
        load(missing)
    assert str(missing) in str(caught.value)


@pytest.mark.parametrize("content", [b"segments,device_traces\n1,2\n", b"", pickle.dumps({"a": [1] * 100})[:-20]],
                         ids=["text", "empty", "truncated"])
def test_reader_rejects_a_file_that_is_not_a_pickle(tmp_path, content):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotError, match="not a pickle") as caught:
        load(path)
    assert str(path) in str(caught.value)


def test_reader_refuses_a_pickle_carrying_a_global_without_running_it(tmp_path):
    marker = tmp_path / "marker"
    path = write_pickle(tmp_path, {"segments": [], "device_traces": [[]], "x": MakesMarker(str(marker))})
    with pytest.raises(SnapshotError) as caught:
        load(path)
    message = str(caught.value)
    assert path in message
    assert "refused" in message and "mkdir" in message and "could run code" in message
    assert not marker.exists()


def test_reader_refuses_the_global_in_the_committed_test_file():
    with pytest.raises(SnapshotError, match=r"refused: the pickle names the global collections\.OrderedDict"):
        load(data("with_global"))


@pytest.mark.parametrize("value, problem", [
    ([1, 2, 3], "the top level is a list, not a dict"),
    ({"segments": []}, "the top level has no 'device_traces'"),
    ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1}]]}, r"device_traces\[0\]\[0\] has no 'size'"),
    ({"segments": [], "device_traces": [[event("grow", 1, 512)]]}, r"device_traces\[0\]\[0\]\['action'\] is 'grow'"),
    ({"segments": [], "device_traces": [[event("alloc", 1, "512")]]},
     r"device_traces\[0\]\[0\]\['size'\] is '512', not an integer"),
    (trace(event("alloc", 1, 512),
           segments=({"address": 1, "total_size": 2 * MiB, "blocks": [{"size": 512, "state": "odd"}]},)),
     r"segments\[0\]\['blocks'\]\[0\]\['state'\] is 'odd'"),
], ids=["list", "no-traces", "event-without-size", "unknown-action", "size-not-int", "bad-block-state"])
def test_reader_rejects_a_pickle_that_is_not_a_snapshot(tmp_path, value, problem):
    path = write_pickle(tmp_path, value)
    with pytest.raises(SnapshotError, match=f"not a memory snapshot: {problem}") as caught:
        load(path)
    assert path in str(caught.value)


def test_reader_rejects_an_empty_trace():
    with pytest.raises(SnapshotError, match="the trace is empty: no device has an alloc or free event") as caught:
        load(data("empty_trace"))
    assert "_record_memory_history" in str(caught.value)


def test_reader_uses_the_event_index_when_time_us_is_missing():
    snapshot = from_dict({"segments": [], "device_traces": [[event("alloc", 1, 512), event("free_completed", 1, 512)]]})
    assert [e.time_us for e in snapshot.events(0)] == [0, 1]
    assert not snapshot.has_times


def test_reader_computes_block_addresses_older_snapshots_leave_out():
    segment = {"address": 4096, "total_size": 2 * MiB,
               "blocks": [{"size": 1024, "state": "active_allocated"}, {"size": 2 * MiB - 1024, "state": "inactive"}]}
    snapshot = from_dict(trace(event("alloc", 1, 512), segments=(segment,)))
    assert [b.address for b in snapshot.segments[0].blocks] == [4096, 4096 + 1024]


# ---- replaying ----------------------------------------------------------------------------------


def test_replay_peak_allocated_equals_the_peak_computed_from_the_trace():
    result = rp.replay(data("big_blocks"), "none")
    assert result.peak_allocated == rp.peak_allocated_from_trace(data("big_blocks"))
    assert result.peak_allocated == EXPECTED["big_blocks"]["peak_allocated"]


def test_replay_peak_allocated_counts_blocks_alive_before_the_trace():
    result = rp.replay(data("preexisting"), "none")
    assert result.initial_blocks == EXPECTED["preexisting"]["initial_blocks"] == 6
    assert result.peak_allocated == rp.peak_allocated_from_trace(data("preexisting"))
    assert result.peak_allocated == EXPECTED["preexisting"]["peak_allocated"]


def test_replay_peak_allocated_is_never_below_the_trace_peak_with_odd_sizes():
    # Large-pool blocks may keep a remainder of up to 1 MiB unsplit; see Note [peak allocated].
    result = rp.replay(data("train_like"), "none")
    trace_peak = rp.peak_allocated_from_trace(data("train_like"))
    assert trace_peak == EXPECTED["train_like"]["peak_allocated"]
    assert trace_peak <= result.peak_allocated


def test_blocks_alive_before_the_trace_are_allocated_first_in_address_order():
    # The lowest-addressed block alive before the trace is 24 MiB: under a 20 MiB limit it fails
    # before any event is replayed.
    result = rp.replay(data("preexisting"), "20MB")
    assert not result.fits
    assert result.failure.event_index is None and result.failure.time_us is None
    assert result.failure.size == 24 * MiB
    assert result.allocs_replayed == 0


def test_replay_below_the_peak_reports_the_failing_request_and_its_size():
    snapshot = from_dict(trace(event("alloc", 0x1000, 100 * MiB), event("alloc", 0x9000_0000, 100 * MiB),
                               event("alloc", 0xA000_0000, 100 * MiB + 3)))
    result = rp.replay(snapshot, "250MB")
    assert not result.fits
    assert (result.failure.event_index, result.failure.time_us) == (2, 300)
    assert result.failure.size == 100 * MiB + 3
    assert result.failure.kind == "over the limit"
    assert result.allocs_replayed == 2


def test_replay_failure_under_the_peak_is_a_request_the_trace_made():
    snapshot = load(data("big_blocks"))
    result = rp.replay(snapshot, EXPECTED["big_blocks"]["peak_allocated"] - MiB)
    failed = snapshot.events(0)[result.failure.event_index]
    assert not result.fits
    assert failed.action == "alloc" and failed.size == result.failure.size


def test_replay_frees_at_free_completed_not_at_free_requested():
    snapshot = from_dict(trace(event("alloc", 1 << 20, 100 * MiB, stream=7),
                               event("free_requested", 1 << 20, 100 * MiB, stream=7),
                               event("alloc", 1 << 30, 100 * MiB),
                               event("free_completed", 1 << 20, 100 * MiB, stream=7)))
    assert rp.peak_allocated_from_trace(snapshot) == 200 * MiB
    assert rp.replay(snapshot, "150MB").failure.event_index == 2


def test_replay_frees_at_free_requested_when_the_trace_has_no_free_completed():
    snapshot = from_dict(trace(event("alloc", 1 << 20, 100 * MiB), event("free_requested", 1 << 20, 100 * MiB),
                               event("alloc", 1 << 30, 100 * MiB)))
    assert rp.peak_allocated_from_trace(snapshot) == 100 * MiB
    assert rp.replay(snapshot, "150MB").fits


def test_replay_keeps_a_block_pending_at_dump_time_allocated():
    pending = {"address": 1 << 20, "total_size": 100 * MiB, "stream": 0,
               "blocks": [{"address": 1 << 20, "size": 100 * MiB, "state": "active_pending_free"}]}
    snapshot = from_dict(trace(event("alloc", 1 << 20, 100 * MiB), event("free_requested", 1 << 20, 100 * MiB),
                               event("alloc", 1 << 30, 100 * MiB), segments=(pending,)))
    assert rp.peak_allocated_from_trace(snapshot) == 200 * MiB


@pytest.mark.parametrize("name", ["train_like", "big_blocks", "preexisting", "two_devices"])
def test_replay_original_peak_reserved_follows_the_segment_events(name):
    result = rp.replay(data(name), "none")
    assert result.original_reserved_source == "trace"
    assert result.original_peak_reserved == EXPECTED[name]["peak_reserved"]


def test_replay_original_reserved_is_the_segments_at_dump_without_segment_events():
    segments = ({"address": a, "total_size": 20 * MiB, "blocks": [{"size": 20 * MiB, "state": "inactive"}]}
                for a in (1 << 30, 2 << 30))
    snapshot = from_dict(trace(event("alloc", 1 << 20, MiB), segments=tuple(segments)))
    result = rp.replay(snapshot, "none")
    assert (result.original_peak_reserved, result.original_reserved_source) == (40 * MiB, "dump")


def test_replay_counts_the_events_it_replayed():
    snapshot = load(data("train_like"))
    result = rp.replay(snapshot, "none")
    actions = [e.action for e in snapshot.events(0)]
    assert result.events_total == len(actions)
    assert result.allocs_replayed == actions.count("alloc")
    assert result.frees_replayed == actions.count("free_completed")
    assert result.original_ooms == actions.count("oom") == 1


def test_replay_picks_the_first_device_with_events():
    assert rp.replay(data("two_devices"), "none").device == 1


def test_replay_of_a_device_without_events_names_the_devices_that_have_some():
    with pytest.raises(SnapshotError, match=r"device 0 has no alloc or free events \(devices with events: 1\)"):
        rp.replay(data("two_devices"), "none", device=0)


def test_replay_takes_an_int_limit_as_bytes():
    assert rp.replay(data("big_blocks"), 3 * GiB).limit == 3 * GiB


def test_replay_takes_percentages_of_the_device_total_the_snapshot_records():
    result = rp.replay(data("train_like"), "50%")
    assert (result.capacity, result.capacity_source, result.limit) == (16 * GiB, "snapshot", 8 * GiB)


def test_replay_sizes_the_device_from_the_trace_without_a_total():
    result = rp.replay(data("preexisting"), "none")
    need = max(EXPECTED["preexisting"]["peak_allocated"], EXPECTED["preexisting"]["peak_reserved"])
    assert result.capacity_source == "trace"
    assert result.capacity >= 2 * need and result.limit == result.capacity


def test_replay_device_grows_to_hold_a_limit_above_twice_the_need():
    result = rp.replay(data("preexisting"), "10GB")
    assert result.capacity == result.limit == 10 * GiB


def test_replay_rejects_a_bad_limit_spec():
    with pytest.raises(ValueError, match='bad limit "4XB"'):
        rp.replay(data("big_blocks"), "4XB")


def test_replay_timeline_is_bounded():
    events = [event(action, 1 << 20, MiB) for _ in range(6000) for action in ("alloc", "free_completed")]
    result = rp.replay(from_dict(trace(*events)), "none")
    assert result.allocs_replayed == 6000
    assert 1000 < len(result.timeline) <= rp.MAX_TIMELINE_POINTS + 2


def test_replay_timeline_starts_with_the_blocks_alive_before_the_trace():
    result = rp.replay(data("preexisting"), "none")
    first_time, allocated, _ = result.timeline[0]
    first_event = next(e for e in load(data("preexisting")).events(0) if e.action in ("alloc", "free_requested"))
    assert first_time == first_event.time_us
    assert allocated == sum(rp.block_size(s) for s in (24 * MiB, 300 * KiB, 6 * MiB, 16 * MiB, 100 * KiB, 14 * MiB))


# ---- real runs ----------------------------------------------------------------------------------


@real_runs
def test_reader_accepts_a_snapshot_pytorch_wrote(name):
    snapshot = load(data(name))
    assert snapshot.devices() == [0] and snapshot.has_times
    assert {e.action for e in snapshot.events(0)} >= {"alloc", "free_requested", "free_completed", "segment_alloc"}


@real_runs
def test_replay_of_a_real_run_with_plain_segments_reproduces_pytorchs_peak_allocated(name):
    # Recorded under PyTorch's allocator with plain segments: gpumem's plain segments split blocks
    # as it did. Growable segments lay blocks out differently (see the next test).
    result = rp.replay(data(name), "none", segments="plain")
    assert result.peak_allocated == CAPTURED[name]["torch_max_memory_allocated"]


@real_runs
def test_replay_of_a_real_run_with_growable_segments_peaks_at_least_at_the_trace_peak(name):
    # See Note [peak allocated]: never below the trace's peak, above it only by unsplit remainders.
    result = rp.replay(data(name), "none")
    assert result.segments == "growable"
    assert result.peak_allocated >= rp.peak_allocated_from_trace(data(name))


@real_runs
def test_original_peak_reserved_of_a_real_run_is_what_pytorch_reported(name):
    result = rp.replay(data(name), "none")
    assert result.original_reserved_source == "trace"
    assert result.original_peak_reserved == CAPTURED[name]["torch_max_memory_reserved"]


@real_runs
def test_a_real_run_started_recording_with_blocks_alive(name):
    # The parameters (alive at dump) and the warm-up batch (freed in the trace) predate the trace.
    snapshot = load(data(name))
    result = rp.replay(snapshot, "none")
    first_action: dict[int, str] = {}
    for e in snapshot.events(0):
        if e.action in ("alloc", "free_requested"):
            first_action.setdefault(e.addr, e.action)
    freed_first = [addr for addr, action in first_action.items() if action == "free_requested"]
    assert freed_first and result.initial_blocks > len(freed_first)


# ---- the smallest limit -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_min_limit():
    return rp.min_limit(data("train_like"), precision=64 * KiB)


def test_min_limit_is_at_least_the_peak_allocated(train_min_limit):
    assert train_min_limit.peak_allocated == EXPECTED["train_like"]["peak_allocated"]
    assert train_min_limit.limit >= train_min_limit.peak_allocated


def test_replay_fits_at_the_min_limit_and_fails_one_precision_below(train_min_limit):
    assert rp.replay(data("train_like"), train_min_limit.limit).fits
    assert not rp.replay(data("train_like"), train_min_limit.limit - train_min_limit.precision).fits


def test_min_limit_ratio_is_the_limit_over_the_peak_allocated(train_min_limit):
    assert train_min_limit.ratio == pytest.approx(train_min_limit.limit / train_min_limit.peak_allocated)


def test_min_limit_rounds_the_precision_up_to_512_bytes():
    assert rp.min_limit(data("big_blocks"), precision=1000).precision == 1024


def test_min_limit_is_the_peak_when_nothing_fragments():
    snapshot = from_dict(trace(*[event("alloc", (i + 1) << 30, 20 * MiB) for i in range(3)]))
    assert rp.min_limit(snapshot).limit == 60 * MiB


def test_a_coarser_least_chunk_replays_with_its_chunks_and_needs_a_higher_cap():
    # Three 20 MiB requests: pages map exactly 60 MiB; 16 MiB chunks map 32 MiB for the first, the
    # rest of each last chunk cached for the next, 64 MiB in all. Under a 60 MiB cap the third
    # falls back to pages, but the 8 MiB free in the second's last chunk cannot go back.
    snapshot = from_dict(trace(*[event("alloc", (i + 1) << 30, 20 * MiB) for i in range(3)]))
    assert rp.replay(snapshot, "none", chunk="16MB").peak_reserved == 64 * MiB
    assert rp.replay(snapshot, "none", chunk=0).peak_reserved == 60 * MiB
    assert rp.min_limit(snapshot, chunk="16MB").limit == 64 * MiB
    assert rp.min_limit(snapshot, chunk=0).limit == 60 * MiB
    pages, coarse = (rp.min_limit(data("big_blocks"), chunk=c) for c in (0, "16MB"))
    assert coarse.limit > pages.limit


def test_the_free_part_of_a_large_tensors_last_chunk_counts_under_the_cap():
    # docs/usage.md, "Chunks": 602 MiB is mapped in 4 MiB chunks, the last one half used; the 2 MiB
    # free in it stays while the tensor lives, so with a 300 MiB tensor after it the cap must be
    # 904 MiB, where their pages make 902.
    snapshot = from_dict(trace(event("alloc", 1 << 30, 602 * MiB), event("alloc", 2 << 30, 300 * MiB)))
    found = rp.min_limit(snapshot)
    assert found.peak_allocated == 902 * MiB and found.limit == 904 * MiB
    assert not rp.replay(snapshot, 902 * MiB).fits


@pytest.mark.parametrize("chunk", ["fast", "1GB", -1, 1.5])
def test_a_bad_chunk_is_refused_naming_it_and_the_forms(chunk):
    with pytest.raises((ValueError, TypeError)) as caught:
        rp.replay(data("big_blocks"), "none", chunk=chunk)
    assert str(chunk) in str(caught.value) and "a byte count" in str(caught.value)


def test_min_limit_is_none_when_the_trace_does_not_fit_in_the_device():
    found = rp.min_limit(data("big_blocks"), total=512 * MiB)
    assert found.limit is None and found.ratio is None


def test_min_limit_rejects_a_precision_that_is_not_positive():
    with pytest.raises(ValueError, match="precision 0"):
        rp.min_limit(data("big_blocks"), precision=0)


@pytest.mark.parametrize("precision", [1 << 64, (1 << 64) - 1, _C.SIM_MAX_CAPACITY + 1])
def test_min_limit_rejects_a_precision_above_the_largest_simulated_device_naming_it(precision):
    with pytest.raises(ValueError, match=f"precision {precision} is not a number of bytes from 1"):
        rp.min_limit(data("big_blocks"), precision=precision)


@pytest.mark.parametrize("precision", [1.5, "1MiB", True])
def test_min_limit_rejects_a_precision_that_is_not_an_int(precision):
    with pytest.raises(TypeError, match="is not an int number of bytes"):
        rp.min_limit(data("big_blocks"), precision=precision)


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 1 << 62])
def test_the_replays_block_size_is_the_allocators_own(size):
    sim = _C.SimAllocator(1 << 50)
    if size <= 1 << 40:
        sim.malloc(0, size)
        assert sim.stats(0)["allocated_bytes.all.current"] == rp.block_size(size)
    assert rp.block_size(size) == max(512, -(-size // 512) * 512)


# ---- segments -----------------------------------------------------------------------------------

SYNTHETIC = ["train_like", "big_blocks", "preexisting", "two_devices"]


def core_maps_growable_segments() -> bool:
    """Whether the core serves requests from growable segments on a device that maps pages."""
    sim = _C.SimAllocator(GiB, page_size=rp.PAGE_SIZE)
    sim.malloc(0, 4 * MiB)
    return any(segment["is_expandable"] for segment in sim.snapshot(0))


# Comparisons of the two kinds mean something only once the core implements growable segments
# (core/growable_segments.cpp); before that both replays use plain segments, and these tests skip.
needs_growable_core = pytest.mark.skipif(not core_maps_growable_segments(),
                                         reason="the core does not map growable segments yet")


def test_replay_uses_growable_segments_by_default():
    assert rp.replay(data("train_like"), "none").segments == "growable"
    assert rp.min_limit(data("two_devices")).segments == "growable"


@pytest.mark.parametrize("kind", ["growable", "plain"])
def test_replay_says_which_segments_it_used(kind):
    assert rp.replay(data("train_like"), "none", segments=kind).segments == kind
    assert rp.min_limit(data("two_devices"), segments=kind).segments == kind


@pytest.mark.parametrize("kind", ["grow", "", "cudaMalloc"])
def test_replay_rejects_a_bad_segment_kind_naming_it_and_the_forms(kind):
    with pytest.raises(ValueError) as caught:
        rp.replay(data("train_like"), "none", segments=kind)
    assert repr(kind) in str(caught.value) and '"growable" or "plain"' in str(caught.value)
    with pytest.raises(ValueError, match=r'"growable" or "plain"'):
        rp.min_limit(data("train_like"), segments=kind)


@pytest.mark.parametrize("kind", ["growable", "plain"])
@pytest.mark.parametrize("name", SYNTHETIC)
def test_replay_with_either_segments_fits_at_its_min_limit_and_fails_below(name, kind):
    found = rp.min_limit(data(name), precision=256 * KiB, segments=kind)
    at = rp.replay(data(name), found.limit, segments=kind)
    assert at.fits and at.peak_reserved <= found.limit
    if found.limit > found.peak_allocated:
        assert not rp.replay(data(name), found.limit - found.precision, segments=kind).fits


@pytest.mark.parametrize("kind", ["growable", "plain"])
@pytest.mark.parametrize("name", SYNTHETIC)
def test_replay_with_either_segments_keeps_reserved_under_the_limit(name, kind):
    result = rp.replay(data(name), "none", segments=kind)
    limit = max(result.peak_allocated, result.original_peak_reserved)
    capped = rp.replay(data(name), limit, segments=kind)
    assert capped.peak_reserved <= limit
    assert max(r for _, _, r in capped.timeline) <= limit


# The point of growable segments: memory freed in one place serves a larger request elsewhere, so a
# trace fits under a lower limit. Asserted on the real runs.
@needs_growable_core
@real_runs
def test_growable_segments_need_no_higher_limit_than_plain_ones_on_a_real_run(name):
    growable = rp.min_limit(data(name), segments="growable")
    plain = rp.min_limit(data(name), segments="plain")
    assert growable.limit is not None and plain.limit is not None
    assert growable.limit <= plain.limit


@needs_growable_core
@real_runs
def test_a_real_run_fits_with_growable_segments_under_the_min_limit_plain_ones_need(name):
    plain = rp.min_limit(data(name), segments="plain")
    assert rp.replay(data(name), plain.limit, segments="growable").fits


def test_a_failure_replaying_another_device_names_that_device():
    snapshot = {"segments": [], "device_traces": [[], [event("alloc", 1 << 20, 300 * MiB)]]}
    result = rp.replay(from_dict(snapshot), 100 * MiB)
    assert not result.fits
    assert result.failure.kind == "over the limit"
    assert "GPU 1 " in result.failure.message and "GPU 0" not in result.failure.message


@pytest.mark.parametrize("total", [_C.SIM_MAX_CAPACITY + 1, 1 << 62])
def test_a_device_total_the_simulator_cannot_model_is_a_clear_error(total):
    snapshot = trace(event("alloc", 1 << 20, MiB), gpumem_device_totals=[total])
    with pytest.raises(ValueError, match="the snapshot's total for device 0 .* is not a device size the simulator models"):
        rp.replay(from_dict(snapshot), "none")
    with pytest.raises(ValueError, match="the given device total .* simulator models"):
        rp.replay(from_dict(trace(event("alloc", 1 << 20, MiB))), "none", total=total)


# ---- sizes that add up past 2^64 -----------------------------------------------------------------

HUGE = 1 << 62  # the largest size a snapshot may hold


def huge_trace(count: int = 8) -> dict:
    """`count` segments of HUGE bytes, each one block alive before the trace: each size within
    range, their sum past 2^64 once count passes 4."""
    segments = tuple({"device": 0, "address": n << 40, "total_size": HUGE, "allocated_size": HUGE,
                      "blocks": [{"address": n << 40, "size": HUGE, "state": "active_allocated"}]}
                     for n in range(count))
    return trace(event("alloc", 1 << 63, 512), segments=segments)


def test_replay_of_sizes_adding_up_past_2_to_the_64_names_the_device_it_would_need():
    with pytest.raises(ValueError, match=r"the device the trace needs \(twice its peak\) \(67108864.00 TiB\) is "
                                         r"not a device size the simulator models.*--device-total"):
        rp.replay(from_dict(huge_trace()), None)


def test_replay_of_sizes_adding_up_past_2_to_the_64_on_a_given_device_reports_them():
    result = rp.replay(from_dict(huge_trace()), None, total=80 * GiB)
    assert not result.fits and result.failure.size == HUGE
    assert result.original_peak_reserved == 8 * HUGE
