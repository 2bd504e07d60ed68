"""GPUMEM_LIMIT caps a program that never imports gpumem (gpumem-autoload.pth), on a GPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20

# Holds 384 MiB, then asks for 256 MiB more: over a 512 MB cap, well within any device.
PROGRAM = """
import json, sys, torch
held = [torch.empty(128 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
try:
    torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    error = None
except torch.OutOfMemoryError as e:
    error = str(e)
stats = torch.cuda.memory_stats()
backend = getattr(torch.cuda.memory, "get_allocator_backend", lambda: None)()
import gpumem
print(json.dumps({"gpumem loaded": "gpumem" in sys.modules, "enabled": gpumem.is_enabled(), "backend": backend,
                  "error": error,
                  "reserved peak": stats["reserved_bytes.all.peak"],
                  "allocated": stats["allocated_bytes.all.current"]}))
"""


def run(program: str, limit: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUMEM_LIMIT": limit}
    return subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def capped():
    completed = run(PROGRAM, "512MB")
    assert completed.returncode == 0, completed.stderr[-6000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_gpumem_is_the_allocator_though_the_program_never_imports_it(capped):
    assert capped["gpumem loaded"] and capped["enabled"]
    if capped["backend"] is not None:
        assert capped["backend"] == "native"  # gpumem stands in for it: see csrc/torch/allocator.h


def test_an_allocation_over_the_cap_raises_gpumems_out_of_memory_error(capped):
    assert capped["error"] is not None and "gpumem" in capped["error"]


def test_reserved_memory_never_passes_the_cap(capped):
    assert capped["allocated"] == 384 * MiB
    assert capped["reserved peak"] <= 512 * MiB


def test_a_limit_larger_than_the_device_is_an_error_at_first_cuda_use_and_after():
    program = """
import json, torch
errors = []
for _ in range(2):
    try:
        torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        errors.append(None)
    except Exception as e:  # ValueError: the limit's value is bad
        errors.append(type(e).__name__ + ": " + str(e))
print(json.dumps(errors))
"""
    completed = run(program, "1000000GB")
    assert completed.returncode == 0, completed.stderr[-6000:]
    errors = json.loads(completed.stdout.strip().splitlines()[-1])
    for error in errors:
        assert error is not None and error.startswith('ValueError: gpumem: bad GPUMEM_LIMIT "1000000GB": ')
        assert "more than the device total" in error
