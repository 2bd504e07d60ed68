"""What the Python benchmarks share: picking the allocator before torch starts, capping it, and output.

Each benchmark process measures one allocator, named on its command line:
  gpumem              gpumem installed as torch's CUDA allocator (gpumem.enable()), growable segments
  gpumem-plain        the same with plain segments (GPUMEM_SEGMENTS=plain)
  native              PyTorch's own caching allocator
  native-expandable   the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
The choice has to be made before torch initializes CUDA (and, for the environment variable,
before torch is imported), so `select_allocator` is the first thing a benchmark calls.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

ALLOCATORS = ("gpumem", "gpumem-plain", "native", "native-expandable")


def select_allocator(name: str) -> None:
    """Makes `name` the allocator of this process; call before importing torch."""
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; one of {ALLOCATORS}")
    if "torch" in sys.modules and name == "native-expandable":
        raise RuntimeError("select_allocator must run before torch is imported")
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.pop("GPUMEM_SEGMENTS", None)
    if name == "native-expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if name == "gpumem-plain":
        os.environ["GPUMEM_SEGMENTS"] = "plain"
    import gpumem  # imports torch; installs nothing by itself

    if name.startswith("gpumem"):
        gpumem.enable()


def check_allocator(name: str) -> None:
    """Fails unless CUDA is up with the allocator `name` asked for (GPUMEM_LIMIT could install gpumem)."""
    import gpumem
    import torch

    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    torch.empty(1, device="cuda")  # initializes CUDA and the allocator
    if gpumem.is_enabled() != name.startswith("gpumem"):
        sys.exit(f"asked for allocator {name!r} but gpumem.is_enabled() is {gpumem.is_enabled()}; "
                 "unset GPUMEM_LIMIT")
    if name.startswith("gpumem"):
        wanted = "plain" if name == "gpumem-plain" else "growable"
        if gpumem.get_segments() != wanted:
            sys.exit(f"asked for allocator {name!r} but gpumem's segments are {gpumem.get_segments()!r}")


def apply_cap(allocator: str, cap: int) -> int:
    """Caps the process at `cap` bytes the way `allocator` can; returns the limit in force."""
    import torch

    if allocator.startswith("gpumem"):
        import gpumem

        gpumem.set_limit(cap)
        return gpumem.get_limit()
    total = torch.cuda.mem_get_info()[1]  # the total native's fraction is taken of
    torch.cuda.set_per_process_memory_fraction(cap / total)
    return int(cap / total * total)  # native's limit: fraction x total, rounded down


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median(values) -> float:
    return statistics.median(values)


def write_json(path: str, record: dict) -> None:
    text = json.dumps(record, indent=1, sort_keys=True)
    if path:
        with open(path, "w") as file:
            file.write(text + "\n")
    print(text)
