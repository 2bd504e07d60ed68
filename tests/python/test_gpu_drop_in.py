"""What the code around PyTorch sees under gpumem, on a GPU: no CUDA at import, torch's allocator
settings, the capped mem_get_info, and the patterns of libraries that size themselves from it
(HF accelerate's where it is installed)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GiB, MiB = 1 << 30, 1 << 20
SETTINGS = ("GPUMEM_LIMIT", "GPUMEM_SEGMENTS", "GPUMEM_MEM_INFO", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {name: value for name, value in os.environ.items() if name not in SETTINGS}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**environ, **env},
                          capture_output=True, text=True, timeout=300)


def result(code: str, **env: str):
    completed = run(code, **env)
    assert completed.returncode == 0, completed.stderr[-6000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


# ---- no CUDA at import ----------------------------------------------------------------------------


def test_import_torch_leaves_the_driver_uninitialized():
    # CUDA_ERROR_NOT_INITIALIZED (3) straight after `import torch`, as natively.
    code = """
        import ctypes, json, sys, torch
        count = ctypes.c_int()
        status = ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(count))
        print(json.dumps([status, sys.modules["gpumem._autoload"].state]))
    """
    assert result(code, GPUMEM_LIMIT="4GB") == [3, "installed"]


def test_cuda_visible_devices_set_after_import_torch_is_honoured():
    code = """
        import json, os, torch
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        print(json.dumps(torch.cuda.is_available()))
    """
    assert result(code) is False  # natively
    assert result(code, GPUMEM_LIMIT="4GB") is False


def test_a_child_forked_before_cuda_is_used_can_use_it_under_the_cap():
    code = """
        import json, os, torch
        pid = os.fork()
        if pid == 0:
            try:
                torch.empty(1 << 20, device="cuda")
                import gpumem
                os._exit(0 if gpumem.get_limit() == 1 << 30 else 4)
            except BaseException:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)))
    """
    assert result(code, GPUMEM_LIMIT="1GiB") == 0


def test_a_device_the_limit_names_that_is_not_there_is_an_error_at_first_use():
    code = """
        import json, torch
        try:
            torch.zeros(1, device="cuda")
            print(json.dumps(None))
        except ValueError as e:
            print(json.dumps(str(e)))
    """
    count = torch.cuda.device_count()
    error = result(code, GPUMEM_LIMIT=f"{count}:1GB")
    assert error is not None and f'bad GPUMEM_LIMIT "{count}:1GB": there is no CUDA device {count}' in error


def test_a_percentage_applies_at_first_use():
    code = """
        import json, torch, gpumem
        torch.zeros(1, device="cuda")
        print(json.dumps([gpumem.get_limit(0), torch.cuda.get_device_properties(0).total_memory]))
    """
    limit, total = result(code, GPUMEM_LIMIT="25%")
    assert abs(limit - total // 4) <= 1


# ---- torch's allocator settings ---------------------------------------------------------------------

FRACTION = """
    import json, torch, gpumem
    device = torch._C._cuda_getDevice()
    print(json.dumps([torch.cuda.memory.get_per_process_memory_fraction(device), gpumem.get_limit(device),
                      torch.cuda.get_device_properties(device).total_memory]))
"""


@pytest.mark.parametrize("fraction", ["0.0", "0.5", "1.0"])
def test_per_process_memory_fraction_sets_the_cap_as_natively(fraction):
    native = result(FRACTION.replace("gpumem.get_limit(device)", "0").replace(", gpumem", ""),
                    PYTORCH_CUDA_ALLOC_CONF=f"per_process_memory_fraction:{fraction}")
    ours = result(FRACTION, PYTORCH_CUDA_ALLOC_CONF=f"per_process_memory_fraction:{fraction}", GPUMEM_LIMIT="none")
    assert ours[0] == native[0] == float(fraction)
    assert ours[1] == int(float(fraction) * ours[2])


def test_the_lower_of_the_fraction_and_gpumem_limit_holds():
    reported, limit, total = result(FRACTION, PYTORCH_CUDA_ALLOC_CONF="per_process_memory_fraction:0.5",
                                    GPUMEM_LIMIT="4GiB")
    assert limit == 4 * GiB and reported == 0.5  # the fraction set reads back; the limit is gpumem's
    _, limit, total = result(FRACTION, PYTORCH_CUDA_ALLOC_CONF="per_process_memory_fraction:0.01",
                             GPUMEM_LIMIT="4GiB")
    assert limit == int(0.01 * total)


SET_FRACTIONS = """
    import json, torch, gpumem
    limit = (lambda: gpumem.get_limit(0)) if gpumem.is_enabled() else (lambda: None)
    seen = [[torch.cuda.get_per_process_memory_fraction(0), limit()]]
    for fraction in (1.0, 0.0, 0.3):
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        seen.append([torch.cuda.get_per_process_memory_fraction(0), limit()])
    print(json.dumps([seen, torch.cuda.get_device_properties(0).total_memory]))
"""


def test_get_per_process_memory_fraction_reads_back_what_was_set_under_gpumem_limit():
    native, _ = result(SET_FRACTIONS)
    ours, total = result(SET_FRACTIONS, GPUMEM_LIMIT="4GiB")
    assert [fraction for fraction, _ in native] == pytest.approx([1.0, 1.0, 0.0, 0.3])
    assert ours == [[1.0, 4 * GiB], [1.0, total], [0.0, 0], [0.3, int(0.3 * total)]]


@pytest.mark.parametrize("fraction", ["-0.1", "1.1"])
def test_an_invalid_fraction_fails_as_natively(fraction):
    completed = run(FRACTION, PYTORCH_CUDA_ALLOC_CONF=f"per_process_memory_fraction:{fraction}", GPUMEM_LIMIT="4GB")
    assert completed.returncode != 0
    assert "per_process_memory_fraction is invalid" in completed.stderr


def test_expandable_segments_and_garbage_collection_threshold_reach_gpumem():
    code = """
        import json, torch, gpumem
        torch.zeros(1, device="cuda")
        before = [gpumem.get_segments(), gpumem._C.get_release_threshold(0)]
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
        print(json.dumps(before + [gpumem.get_segments()]))
    """
    assert result(code, GPUMEM_LIMIT="8GB",
                  PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False,garbage_collection_threshold:0.6") == [
        "plain", 0.6, "growable"]


def test_gpumem_segments_wins_over_torchs_expandable_segments():
    code = """
        import json, torch, gpumem
        torch.zeros(1, device="cuda")
        print(json.dumps(gpumem.get_segments()))
    """
    assert result(code, GPUMEM_LIMIT="8GB", GPUMEM_SEGMENTS="growable",
                  PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False") == "growable"


def test_settings_gpumem_ignores_are_named_in_one_warning():
    completed = run("""
        import torch
        torch.zeros(1, device="cuda")
        torch.zeros(1 << 20, device="cuda")
    """, GPUMEM_LIMIT="8GB", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128,max_non_split_rounding_mb:64")
    assert completed.returncode == 0, completed.stderr[-6000:]
    warnings = [line for line in completed.stderr.splitlines() if "gpumem ignores" in line]
    assert len(warnings) == 1
    assert "max_split_size_mb, max_non_split_rounding_mb" in warnings[0]


def test_backend_native_in_the_settings_works_under_gpumem():
    code = """
        import json, torch
        x = torch.ones(1 << 20, device="cuda")
        print(json.dumps([torch.cuda.memory.get_allocator_backend(), x.sum().item()]))
    """
    assert result(code, GPUMEM_LIMIT="8GB", PYTORCH_CUDA_ALLOC_CONF="backend:native,expandable_segments:True") == [
        "native", float(1 << 20)]


def test_backend_cuda_malloc_async_with_gpumem_limit_stops_at_start_naming_both():
    completed = run("import torch\nprint('the program ran')", GPUMEM_LIMIT="8GB",
                    PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    assert completed.returncode == 2 and "the program ran" not in completed.stdout
    assert "GPUMEM_LIMIT" in completed.stderr and "cudaMallocAsync" in completed.stderr
    assert "Traceback" not in completed.stderr


# ---- memory snapshots ---------------------------------------------------------------------------------

# torch's test_memory_plots: once trace_plot(filter_freed=True) has dropped the alloc and free
# entries of every freed tensor, the 128x128 float tensor's 65536 bytes remain as the requested size
# of the free block it was freed into (Note [the requested size of a free block], torch/history.h).
FREED_INTO = """
    import json, torch
    from torch.cuda._memory_viz import trace_plot
    torch.cuda.memory._record_memory_history("all", context=CONTEXT, stacks="python")
    x = torch.rand(128, 128, device="cuda")
    address = x.data_ptr()
    x * x + x * x
    del x
    snapshot = torch.cuda.memory._snapshot()
    trace_plot(snapshot, filter_freed=True)
    shown = [b["requested_size"] for s in snapshot["segments"] for b in s["blocks"]
             if b["state"] == "inactive" and b["address"] <= address < b["address"] + b["size"]]
    print(json.dumps([shown, str(128 * 128 * 4) in json.dumps(snapshot)]))
"""


@pytest.mark.parametrize("context", ["None", "'all'"])
def test_a_free_block_shows_the_size_of_the_tensor_freed_into_it_as_natively(context):
    code = FREED_INTO.replace("CONTEXT", context)
    assert result(code) == [[65536], True]  # natively
    assert result(code, GPUMEM_LIMIT="4GB") == [[65536], True]


# ---- mem_get_info under a cap -------------------------------------------------------------------------


def test_mem_get_info_shows_the_capped_device_and_device_mem_info_the_real_one():
    code = """
        import json, torch, gpumem
        gpumem.set_limit("4GiB")
        held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        free, total = torch.cuda.mem_get_info()
        accel = list(torch.accelerator.get_memory_info(0)) if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "get_memory_info") else None
        device = gpumem.device_mem_info()
        print(json.dumps([free, total, torch.cuda.memory_reserved(), device, accel]))
    """
    free, total, reserved, device, accel = result(code)
    assert total == 4 * GiB and free == 4 * GiB - reserved
    assert device[1] == torch.cuda.get_device_properties(0).total_memory > total
    if accel is not None:
        assert accel == [free, total]


def test_a_buffer_sized_from_mem_get_info_fits_under_the_cap_and_trains_a_step():
    # The vLLM/sglang pattern: take 90% of the free memory for a cache, then run the model.
    code = """
        import json, torch, gpumem
        gpumem.set_limit("3GiB")
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)).cuda()
        free, total = torch.cuda.mem_get_info()
        cache = torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(64, 1024, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        print(json.dumps([total, torch.cuda.max_memory_reserved(), loss.item() > 0]))
    """
    total, peak, ok = result(code)
    assert total == 3 * GiB and peak <= 3 * GiB and ok


def test_accelerate_get_max_memory_reports_the_cap():
    pytest.importorskip("accelerate")
    code = """
        import json, torch, gpumem
        from accelerate.utils import get_max_memory
        gpumem.set_limit("8GB")
        print(json.dumps(get_max_memory()[0]))
    """
    assert result(code) <= 8 * GiB  # gpumem's units are binary: 8GB = 8 GiB


FIND_BATCH = """
    import json, torch
    from accelerate.utils import find_executable_batch_size
    {setup}
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
    tried = []

    @find_executable_batch_size(starting_batch_size=4096)
    def train(batch_size):
        tried.append(batch_size)
        x = torch.randn(batch_size, 64, 4096, device="cuda")
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        return batch_size

    print(json.dumps([train(), tried]))
"""


def test_accelerate_find_executable_batch_size_settles_under_the_cap_as_natively():
    pytest.importorskip("accelerate")
    native = result(FIND_BATCH.format(setup="torch.cuda.set_per_process_memory_fraction(3 * 2**30 / torch.cuda.get_device_properties(0).total_memory)"))
    ours = result(FIND_BATCH.format(setup="import gpumem; gpumem.set_limit('3GiB')"))
    print(f"\nfind_executable_batch_size under 3 GiB: native settled on {native[0]} (tried {native[1]}), "
          f"gpumem on {ours[0]} (tried {ours[1]})")
    # The same steps down; gpumem's growable segments may fit a step more than native's cache.
    assert ours[0] < 4096 and ours[1] == native[1][:len(ours[1])]
    assert native[0] <= ours[0] and len(native[1]) - len(ours[1]) <= 1
