"""torch.cuda's memory functions under gpumem. Each test runs in a fresh process (see run_python)."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20

STATS_KEYS = """
x = torch.ones(1 << 20, device="cuda")
print(json.dumps(sorted(torch.cuda.memory_stats())))
"""


def test_tensors_are_allocated_by_gpumem(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        print(json.dumps(gpumem.stats()))
        """
    )
    assert result["allocated_bytes.all.current"] >= 64 * MiB
    assert result["num_device_alloc"] >= 1


def test_memory_stats_have_the_native_allocators_keys(run_python):
    native = run_python(STATS_KEYS)
    capped = run_python('gpumem.set_limit("1GB")', STATS_KEYS)
    assert set(capped) == set(native)


def test_memory_stats_values_are_consistent(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 3 << 20, 50 << 20, 200 << 20)]
        del tensors[1]
        stats = torch.cuda.memory_stats()
        print(json.dumps({
            "stats": stats,
            "gpumem_stats": gpumem.stats(),
            "memory_allocated": torch.cuda.memory_allocated(),
            "memory_reserved": torch.cuda.memory_reserved(),
            "live_bytes": sum(t.numel() for t in tensors),
            "limit": gpumem.get_limit(),
        }))
        """
    )
    stats = result["stats"]
    allocated = stats["allocated_bytes.all.current"]
    reserved = stats["reserved_bytes.all.current"]
    assert result["live_bytes"] <= allocated <= reserved <= result["limit"]
    assert result["memory_allocated"] == allocated
    assert result["memory_reserved"] == reserved
    assert result["gpumem_stats"]["allocated_bytes.all.current"] == allocated
    assert stats["allocation.all.current"] == 3
    assert stats["allocated_bytes.all.peak"] >= allocated + (3 << 20)


def test_memory_summary_reports_gpumem_memory(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        x = torch.empty(100 << 20, dtype=torch.uint8, device="cuda")
        print(json.dumps(torch.cuda.memory_summary()))
        """
    )
    assert "PyTorch CUDA memory summary" in result
    allocated_row = next(line for line in result.splitlines() if line.startswith("| Allocated memory"))
    assert "102400 KiB" in allocated_row  # torch prints sizes below 768 MiB in KiB
    assert "GPU reserved memory" in result


def test_reset_peak_memory_stats_resets_gpumem_peaks(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        del x
        before = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        print(json.dumps({"before": before, "after": torch.cuda.max_memory_allocated(),
                          "allocated": torch.cuda.memory_allocated()}))
        """
    )
    assert result["before"] >= 256 * MiB
    assert result["after"] == result["allocated"]


EMPTY_CACHE = """
gpumem.set_limit("1GB")
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
del x
torch.cuda.synchronize()
reserved_before, free_before = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
{call}
reserved_after, free_after = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
print(json.dumps({{"reserved_before": reserved_before, "reserved_after": reserved_after,
                  "returned_to_cuda": free_after - free_before}}))
"""


@pytest.mark.parametrize("call", ["torch.cuda.empty_cache()", "gpumem.empty_cache()"])
def test_empty_cache_returns_cached_memory_to_cuda(run_python, call):
    result = run_python(EMPTY_CACHE.format(call=call))
    assert result["reserved_before"] >= 256 * MiB
    assert result["reserved_after"] <= result["reserved_before"] - 256 * MiB
    # Other processes on the GPU can move free memory a little; 256 MiB went back.
    assert result["returned_to_cuda"] >= 128 * MiB


def test_set_per_process_memory_fraction_sets_the_byte_cap(run_python):
    result = run_python(
        """
        gpumem.enable()
        torch.cuda.set_per_process_memory_fraction(0.25)
        print(json.dumps({"limit": gpumem.get_limit(), "total": torch.cuda.get_device_properties(0).total_memory}))
        """
    )
    assert abs(result["limit"] - 0.25 * result["total"]) <= 2 * MiB


def test_a_fraction_cap_refuses_a_request_beyond_it(run_python):
    result = run_python(
        """
        gpumem.enable()
        torch.cuda.set_per_process_memory_fraction(0.25)
        total = torch.cuda.get_device_properties(0).total_memory
        try:
            torch.empty(int(0.3 * total), dtype=torch.uint8, device="cuda")
            print(json.dumps(None))
        except torch.OutOfMemoryError as error:
            print(json.dumps(str(error)))
        """
    )
    assert result is not None, "a request of 30% of the device passed a 25% cap"
    assert "gpumem: over the limit" in result


def test_caching_allocator_alloc_and_delete_go_through_gpumem(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        before = gpumem.stats()["allocated_bytes.all.current"]
        pointer = torch.cuda.caching_allocator_alloc(8 << 20)
        during = gpumem.stats()["allocated_bytes.all.current"]
        torch.cuda.caching_allocator_delete(pointer)
        after = gpumem.stats()["allocated_bytes.all.current"]
        print(json.dumps({"before": before, "during": during, "after": after, "pointer": pointer}))
        """
    )
    assert result["pointer"] != 0
    assert result["during"] - result["before"] >= 8 * MiB
    assert result["after"] == result["before"]


def test_memory_freed_while_a_side_stream_uses_it_is_not_reused_until_the_stream_is_done(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        side = torch.cuda.Stream()
        x = torch.ones(16 << 20, device="cuda")
        # Load both kernels first: loading a kernel on its first launch waits for the device.
        torch.cuda._sleep(1)
        x * 2
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # keeps the side stream busy for about a second
            y = x * 2
        x.record_stream(side)
        freed = x.data_ptr()
        del x
        z = torch.empty(16 << 20, device="cuda")
        reused_while_busy = z.data_ptr() == freed
        side_was_busy = not side.query()
        side.synchronize()
        print(json.dumps({"reused_while_busy": reused_while_busy, "side_was_busy": side_was_busy,
                          "y_is_right": bool((y == 2).all())}))
        """
    )
    assert result["side_was_busy"], "the side stream finished too soon for the check to mean anything"
    assert not result["reused_while_busy"]
    assert result["y_is_right"]


@pytest.mark.skipif(not hasattr(torch, "accelerator") or not hasattr(torch.accelerator, "memory_stats"),
                    reason="this torch has no torch.accelerator memory functions")
def test_torch_accelerator_memory_functions_report_gpumem(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        x = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")
        print(json.dumps({"accelerator": torch.accelerator.memory_stats()["allocated_bytes.all.current"],
                          "gpumem": gpumem.stats()["allocated_bytes.all.current"]}))
        """
    )
    assert result["accelerator"] == result["gpumem"] >= 96 * MiB


EMPTY_CACHE_SYNCS = """
def syncs():
    return torch.cuda.memory_stats()["num_sync_all_streams"]

x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
del x  # cached: empty_cache has a segment to give back
side = torch.cuda.Stream()
y = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
y.record_stream(side)
del y  # its free waits for the side stream: empty_cache synchronizes for it
before = syncs()
torch.cuda.empty_cache()
pending = syncs() - before
before = syncs()
torch.cuda.empty_cache()  # nothing cached, nothing pending
idle = syncs() - before
print(json.dumps({"pending": pending, "idle": idle}))
"""


@pytest.mark.parametrize("segments", ["growable", "plain"])
def test_one_empty_cache_counts_one_sync_of_all_streams(run_python, segments):
    native = run_python(EMPTY_CACHE_SYNCS)
    capped = run_python(f'gpumem.set_limit("1GB"); gpumem.set_segments("{segments}")', EMPTY_CACHE_SYNCS)
    assert native == {"pending": 1, "idle": 1}  # what gpumem matches
    assert capped == native
