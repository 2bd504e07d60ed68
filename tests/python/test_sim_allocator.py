"""The allocator core from Python, on a simulated device (gpumem._C.SimAllocator): no GPU needed."""
import os
import random

import pytest
import torch

from gpumem import _C

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def sim():
    """A 1 GiB simulated device capped at 256 MiB."""
    allocator = _C.SimAllocator(1 * GiB)
    allocator.set_limit(0, "256MB")
    return allocator


def random_size(rng):
    # Log-uniform from 1 byte to 64 MiB: both pools, every rounding class.
    return int(2 ** rng.uniform(0, 26))


def test_the_cap_holds_across_random_operations(sim):
    rng = random.Random(1234)
    live, ooms = [], 0
    for _ in range(4000):
        if live and rng.random() < 0.45:
            sim.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(sim.malloc(0, random_size(rng), rng.choice([0, 0, 0, 1])))
            except _C.OutOfMemoryError:
                ooms += 1
        assert sim.reserved(0) <= 256 * MiB
    sim.check_invariants(0)
    ledger = sim.ledger(0)
    assert ledger["peak"] <= 256 * MiB
    assert ledger["peak"] > 128 * MiB, "the workload never pressed the cap"
    assert ooms > 0, "the workload never hit the cap"


def test_the_cap_holds_with_streams_in_use_and_events_pending(sim):
    rng = random.Random(99)
    live = []
    for step in range(2000):
        if live and rng.random() < 0.5:
            address = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5:
                sim.record_stream(address, rng.choice([1, 2]))
            sim.free(address)
        else:
            try:
                live.append(sim.malloc(0, random_size(rng), rng.choice([0, 1, 2])))
            except _C.OutOfMemoryError:
                pass
        if step % 50 == 0:
            sim.complete_events()
        assert sim.reserved(0) <= 256 * MiB
    sim.check_invariants(0)
    assert sim.ledger(0)["peak"] <= 256 * MiB


def test_out_of_memory_error_is_a_memory_error():
    assert issubclass(_C.OutOfMemoryError, MemoryError)


def test_a_request_over_the_limit_raises_naming_the_case_and_the_numbers(sim):
    with pytest.raises(MemoryError) as caught:
        sim.malloc(0, 300 * MiB)
    message = str(caught.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 300.00 MiB. GPU 0 has a total capacity of")
    assert "gpumem: over the limit, under a limit of 256.00 MiB" in message
    assert "gpumem.set_limit()" in message


def test_an_out_of_memory_error_counts_in_num_ooms(sim):
    with pytest.raises(_C.OutOfMemoryError):
        sim.malloc(0, 300 * MiB)
    assert sim.stats(0)["num_ooms"] == 1


def test_a_device_that_refuses_is_reported_as_device_full(sim):
    sim.fail_next(100)
    with pytest.raises(_C.OutOfMemoryError, match="gpumem: device full"):
        sim.malloc(0, 8 * MiB)
    assert sim.ledger(0)["refusals"] >= 1


def test_the_allocator_recovers_once_the_device_stops_refusing(sim):
    sim.fail_next(1)
    try:
        sim.malloc(0, 8 * MiB)
    except _C.OutOfMemoryError:
        pass
    assert sim.malloc(0, 8 * MiB) > 0


def test_freed_memory_is_cached_until_empty_cache(sim):
    sim.free(sim.malloc(0, 8 * MiB))
    assert sim.reserved(0) >= 8 * MiB
    sim.empty_cache(0)
    assert sim.reserved(0) == 0
    assert sim.ledger(0)["in_use"] == 0


def test_lowering_the_limit_releases_cached_segments(sim):
    sim.free(sim.malloc(0, 100 * MiB))
    sim.set_limit(0, "64MB")
    assert sim.reserved(0) <= 64 * MiB
    assert sim.stats(0)["num_cache_releases"] >= 1


def test_a_limit_lowered_below_live_memory_keeps_it_and_refuses_growth(sim):
    live = sim.malloc(0, 100 * MiB)
    sim.set_limit(0, "64MB")
    assert sim.reserved(0) >= 100 * MiB
    with pytest.raises(_C.OutOfMemoryError):
        sim.malloc(0, 4 * MiB)
    sim.free(live)
    assert sim.malloc(0, 4 * MiB) > 0


def test_a_bad_spec_changes_nothing(sim):
    with pytest.raises(ValueError):
        sim.set_limit(0, "lots")
    assert sim.get_limit(0) == 256 * MiB


def test_no_limit_means_the_device_total():
    sim = _C.SimAllocator(1 * GiB)
    sim.set_limit_bytes(0, 100 * MiB)
    sim.set_limit_bytes(0, None)
    assert sim.get_limit(0) == 1 * GiB
    assert sim.malloc(0, 900 * MiB) > 0


def test_each_device_has_its_own_cap():
    sim = _C.SimAllocator(1 * GiB, 2)
    sim.set_limit(0, "128MB")
    assert sim.malloc(1, 512 * MiB) > 0
    with pytest.raises(_C.OutOfMemoryError):
        sim.malloc(0, 512 * MiB)


def test_memory_freed_while_a_stream_uses_it_is_not_reused_until_the_stream_is_done(sim):
    first = sim.malloc(0, 4 * MiB)
    sim.record_stream(first, 7)
    sim.free(first)
    assert sim.malloc(0, 4 * MiB) != first
    sim.complete_events()
    assert sim.malloc(0, 4 * MiB) == first


def test_a_bad_device_is_refused_naming_it(sim):
    with pytest.raises(ValueError, match="3"):
        sim.malloc(3, 1 * MiB)


# ---- statistics ----------------------------------------------------------------------------------

STAT_ARRAYS = [
    "allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
    "active_bytes", "inactive_split_bytes", "requested_bytes",
]


def torch_memory_stats_keys(monkeypatch):
    """The keys torch.cuda.memory_stats gives, flattened by torch's own code.

    The nested dict is shaped as torch/csrc/cuda/Module.cpp (memoryStats) builds it from a
    c10 DeviceStats; torch.cuda.memory_stats cannot run without a GPU, its flattening can.
    """
    stat = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
    nested = {
        name: 0
        for name in ("num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams",
                     "num_device_alloc", "num_device_free")
    }
    for name in STAT_ARRAYS:
        nested[name] = {pool: dict(stat) for pool in ("all", "small_pool", "large_pool")}
    nested["oversize_allocations"] = dict(stat)
    nested["oversize_segments"] = dict(stat)
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda device=None: nested)
    return set(torch.cuda.memory_stats())


def test_stats_keys_are_torchs_memory_stats_keys_plus_gpumems_own_counters(sim, monkeypatch):
    torch_keys = torch_memory_stats_keys(monkeypatch)
    # The native allocator's oversize figures have no counterpart in gpumem's core.
    native_only = {"max_split_size"} | {
        f"oversize_{what}.{metric}"
        for what in ("allocations", "segments")
        for metric in ("current", "peak", "allocated", "freed")
    }
    gpumem_only = {"num_cache_releases", "num_ooms_over_limit", "num_ooms_device_full", "num_ooms_fragmentation"}
    assert set(sim.stats(0)) == (torch_keys - native_only) | gpumem_only


def test_stats_values_are_ints(sim):
    sim.malloc(0, 1 * MiB)
    assert all(type(value) is int for value in sim.stats(0).values())


def test_stats_agree_with_the_devices_own_ledger(sim):
    rng = random.Random(5)
    live = [sim.malloc(0, random_size(rng)) for _ in range(20)]
    for address in live[::2]:
        sim.free(address)
    stats = sim.stats(0)
    assert stats["reserved_bytes.all.current"] == sim.ledger(0)["in_use"] == sim.reserved(0)
    assert stats["num_device_alloc"] == sim.ledger(0)["reserves"]
    assert 0 < stats["allocated_bytes.all.current"] <= stats["reserved_bytes.all.current"]


def test_allocated_bytes_split_into_the_small_and_the_large_pool(sim):
    sim.malloc(0, 1000)
    sim.malloc(0, 8 * MiB)
    stats = sim.stats(0)
    small = stats["allocated_bytes.small_pool.current"]
    large = stats["allocated_bytes.large_pool.current"]
    assert small >= 1000 and large >= 8 * MiB
    assert stats["allocated_bytes.all.current"] == small + large


def test_requested_bytes_count_what_was_asked_before_rounding(sim):
    sim.malloc(0, 1000)
    stats = sim.stats(0)
    assert stats["requested_bytes.all.current"] == 1000
    assert stats["allocated_bytes.all.current"] >= 1000


# ---- growable segments ---------------------------------------------------------------------------

PAGE = 2 * MiB


@pytest.fixture
def paged():
    """A 1 GiB simulated device that maps 2 MiB pages, capped at 256 MiB."""
    allocator = _C.SimAllocator(1 * GiB, page_size=PAGE)
    allocator.set_limit(0, "256MB")
    return allocator


def test_without_a_page_size_the_device_uses_plain_segments(sim):
    sim.malloc(0, 8 * MiB)
    assert not sim.growable(0)
    assert [s["is_expandable"] for s in sim.snapshot(0)] == [False]
    assert sim.ledger(0)["mapped"] == sim.ledger(0)["address_ranges"] == 0


def test_with_a_page_size_growable_segments_are_used_by_default(paged):
    paged.malloc(0, 8 * MiB)
    assert paged.growable(0)
    assert all(s["is_expandable"] for s in paged.snapshot(0))
    ledger = paged.ledger(0)
    assert ledger["mapped"] == ledger["in_use"] == paged.reserved(0) and ledger["maps"] >= 1
    assert ledger["address_ranges"] >= 1 and ledger["reserves"] == 0


def test_set_growable_off_makes_new_memory_plain(paged):
    paged.set_growable(0, False)
    paged.malloc(0, 8 * MiB)
    assert not paged.growable(0)
    assert [s["is_expandable"] for s in paged.snapshot(0)] == [False]


def test_the_page_size_is_a_keyword():
    with pytest.raises(TypeError):
        _C.SimAllocator(1 * GiB, 1, PAGE)


def test_empty_cache_unmaps_the_pages_of_growable_segments(paged):
    paged.free(paged.malloc(0, 8 * MiB))
    paged.empty_cache(0)
    ledger = paged.ledger(0)
    assert paged.reserved(0) == ledger["in_use"] == ledger["mapped"] == 0
    assert ledger["unmaps"] >= 1


def test_the_cap_holds_with_growable_segments_across_random_operations(paged):
    rng = random.Random(4321)
    live, ooms = [], 0
    for _ in range(4000):
        if live and rng.random() < 0.45:
            paged.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(paged.malloc(0, random_size(rng), rng.choice([0, 0, 0, 1])))
            except _C.OutOfMemoryError:
                ooms += 1
        assert paged.reserved(0) <= 256 * MiB
    paged.check_invariants(0)
    assert paged.ledger(0)["peak"] <= 256 * MiB
    assert ooms > 0, "the workload never hit the cap"


def test_an_out_of_memory_error_carries_its_numbers(sim):
    live = sim.malloc(0, 200 * MiB)
    with pytest.raises(_C.OutOfMemoryError) as caught:
        sim.malloc(0, 100 * MiB)
    error = caught.value
    assert error.case == "over the limit"
    assert (error.device, error.requested, error.limit) == (0, 100 * MiB, 256 * MiB)
    assert error.allocated == sim.stats(0)["allocated_bytes.all.current"]
    assert error.reserved == sim.reserved(0)
    assert error.device_total == 1 * GiB
    assert error.largest_free_block == sim.largest_free_block(0)
    sim.free(live)


def test_an_out_of_memory_error_names_the_device_it_happened_on():
    sim = _C.SimAllocator(1 * GiB, 4)
    with pytest.raises(_C.OutOfMemoryError, match="GPU 3 ") as caught:
        sim.malloc(3, 2 * GiB)
    assert caught.value.device == 3


@pytest.mark.parametrize("capacity", [_C.SIM_MAX_CAPACITY + 1, 1 << 63, (1 << 64) - 1])
def test_a_device_larger_than_the_simulator_models_is_a_value_error(capacity):
    with pytest.raises(ValueError, match=f"{capacity} bytes.*at most {_C.SIM_MAX_CAPACITY} bytes"):
        _C.SimAllocator(capacity)


def test_the_largest_device_serves_a_request_of_half_its_size_and_counts_it_exactly():
    sim = _C.SimAllocator(_C.SIM_MAX_CAPACITY, page_size=2 * MiB)
    half = _C.SIM_MAX_CAPACITY // 2
    addr = sim.malloc(0, half)
    assert sim.stats(0)["allocated_bytes.all.current"] == half
    sim.free(addr)
    with pytest.raises(_C.OutOfMemoryError):
        sim.malloc(0, 1 << 63)
    stats = sim.stats(0)
    assert (stats["allocated_bytes.all.current"], stats["allocated_bytes.all.peak"]) == (0, half)


@pytest.mark.parametrize("growable", [False, True])
def test_frees_above_a_lowered_limit_give_memory_back_until_reserved_is_under_it(growable):
    sim = _C.SimAllocator(8 * GiB, page_size=2 * MiB if growable else 0)
    sim.set_limit(0, "1GB")
    blocks = [sim.malloc(0, 100 * MiB) for _ in range(8)]
    sim.set_limit(0, "100MB")
    assert sim.reserved(0) == 800 * MiB
    for addr in blocks:
        sim.free(addr)
    assert sim.reserved(0) <= 100 * MiB
    sim.malloc(0, 50 * MiB)
    assert sim.ledger(0)["in_use"] == sim.reserved(0) <= 100 * MiB


def test_device_figures_ask_the_driver_only_for_a_device_that_holds_memory():
    # On CUDA, asking a device that holds nothing could make a context the program never made.
    sim = _C.SimAllocator(1 * GiB)
    sim.set_limit(0, "512MB")
    assert sim.device_figures(0)["device_free"] is None
    addr = sim.malloc(0, MiB)
    figures = sim.device_figures(0)
    assert figures["device_free"] == 1 * GiB - figures["reserved"]
    assert figures["device_total"] == 1 * GiB
    sim.free(addr)


def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("page_size", [0, PAGE], ids=["plain", "growable"])
def test_malloc_and_free_in_a_loop_keep_host_memory_flat(page_size):
    # Each Block has one home arena (core/lanes.h); a loop whose calls took different paths once
    # moved a Block to another arena on every pair, about 126 MiB of host memory per million pairs.
    allocator = _C.SimAllocator(1 * GiB, page_size=page_size)
    for _ in range(1000):
        allocator.free(allocator.malloc(0, 4096))
    before = resident_bytes()
    for _ in range(300_000):
        allocator.free(allocator.malloc(0, 4096))
    rng = random.Random(5)
    for _ in range(300):
        allocator.reset_peak_stats(0)  # the whole device between the lanes' calls
        held = [allocator.malloc(0, random_size(rng) % (8 * MiB) + 1, rng.choice([0, 1])) for _ in range(64)]
        for addr in held:
            allocator.free(addr)
    assert resident_bytes() - before < 8 * MiB
    allocator.check_invariants(0)
