"""A limit on the whole process on a GPU: a training loop with cuBLAS and an NCCL process group
(world size 1) under set_limit(..., scope="process"), while this test samples what the driver (NVML)
counts for the job's process. The job asks for more than the limit every step, so the cap binds.

Each job runs in a process of its own (gpumem is installed once per process, before CUDA starts).
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pynvml = pytest.importorskip("pynvml")  # nvidia-ml-py: the test's view of the driver's figures

MiB, GiB = 1 << 20, 1 << 30
LIMIT = 3 * GiB
STEPS = 20

JOB = """
import json, os, sys
import torch, torch.distributed as dist
import gpumem

limit, scope, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
gpumem.set_limit(limit, scope=scope)
device = torch.device("cuda", 0)
# As DDP does: the process group (and NCCL's buffers) first, then the model and the loop.
dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=device)
warm = torch.ones(1 << 20, device=device)
dist.all_reduce(warm)
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).to(device)
optimizer = torch.optim.AdamW(model.parameters())
print("training", flush=True)
ooms, message = 0, ""
for step in range(int(sys.argv[4])):
    x = torch.randn(512, 4096, device=device)
    model(x).square().mean().backward()  # cuBLAS
    for p in model.parameters():
        dist.all_reduce(p.grad)  # NCCL
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    held = []  # a job that wants more than its cap: it grows until refused
    try:
        while True:
            held.append(torch.empty(64 << 20, dtype=torch.uint8, device=device))
    except torch.OutOfMemoryError as error:
        ooms, message = ooms + 1, str(error)
    del held
torch.cuda.synchronize()
figures = gpumem._C.device_figures(0)
print(json.dumps({"ooms": ooms, "message": message, "scope": gpumem.get_scope(0),
                  "outside": figures["outside"], "outside_source": figures["outside_source"],
                  "reserved_peak": torch.cuda.max_memory_reserved()}), flush=True)
dist.destroy_process_group()
"""


def driver_counts(pid: int) -> int:
    """What NVML counts for `pid`, over every GPU; 0 while it is not listed."""
    used = 0
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid and p.usedGpuMemory is not None:
                used += p.usedGpuMemory
    return used


def run_job(scope: str, tmp_path) -> tuple[dict, list[int]]:
    """Runs the job under `scope`; returns what it printed last and NVML's samples of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}
    env.update(GPUMEM_PUBLISH="0", NCCL_DEBUG="WARN")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(JOB), str(LIMIT), scope,
                              str(tmp_path / "store"), str(STEPS)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[int] = []
    done = threading.Event()

    def sample():
        pynvml.nvmlInit()
        try:
            while not done.is_set():
                samples.append(driver_counts(child.pid))
                time.sleep(0.0005)
        finally:
            pynvml.nvmlShutdown()

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        out, err = child.communicate(timeout=240)
    finally:
        done.set()
        sampler.join()
    assert child.returncode == 0, err[-6000:]
    return json.loads(out.strip().splitlines()[-1]), samples


def test_under_the_process_scope_the_driver_never_counts_more_than_the_limit(tmp_path):
    result, samples = run_job("process", tmp_path)
    assert result["scope"] == "process" and result["outside_source"] == "process accounting"
    assert result["ooms"] == STEPS  # the cap refused every step
    assert "on the whole process" in result["message"]
    # The context, cuBLAS's and NCCL's memory were counted: hundreds of MiB outside gpumem.
    assert result["outside"] > 256 * MiB
    peak = max(samples)
    print(f"{len(samples)} NVML samples; the most the driver counted: {peak / MiB:.0f} MiB of a "
          f"{LIMIT / MiB:.0f} MiB limit; outside gpumem: {result['outside'] / MiB:.0f} MiB; gpumem's reserved "
          f"peak: {result['reserved_peak'] / MiB:.0f} MiB")
    assert len(samples) > 100
    assert peak <= LIMIT
    assert peak > LIMIT - 256 * MiB  # the job pressed against the limit, not below it
    assert result["reserved_peak"] + result["outside"] <= LIMIT


def test_under_the_allocator_scope_the_same_job_takes_the_process_past_the_limit(tmp_path):
    # What the process scope is for: capping reserved alone leaves the rest of the process on top.
    result, samples = run_job("allocator", tmp_path)
    assert result["ooms"] == STEPS
    assert result["reserved_peak"] > LIMIT - 128 * MiB
    print(f"allocator scope: the most the driver counted: {max(samples) / MiB:.0f} MiB of a "
          f"{LIMIT / MiB:.0f} MiB limit on reserved")
    assert max(samples) > LIMIT + 256 * MiB
