#!/usr/bin/env python3
"""Allocator cost through PyTorch: torch.empty and release, ns per pair, one allocator per process.

The workload of bench_allocators.cpp seen from Python: sizes log-uniform from 512 B to 64 MiB
(seeded, the same in every process), a ring of 64 live uint8 tensors, each step dropping the
oldest and making the next. The figure includes Python and torch's dispatcher, which both
allocators pay alike. One warm-up pass fills the cache; the result is the median of the timed
passes. benchmarks/run_all.sh alternates processes of the two allocators and takes medians.

--zero makes every tensor 0 bytes: torch creates and releases each tensor as before, but no
allocator hands out or takes back memory (both return at once for 0 bytes), so the figure is the
part of a pair that no allocator can save, the floor under part 2's ratio.

    python3 benchmarks/bench_torch_empty.py --allocator gpumem [--zero] [--pairs N] [--runs R] [--out FILE]
"""
from __future__ import annotations

import argparse
import gc
import math
import random
import time

from common import check_allocator, median, select_allocator, write_json

RING = 64
MiB = 1 << 20


def log_uniform_sizes(n: int, seed: int = 42) -> list[int]:
    rng = random.Random(seed)
    low, high = math.log(512), math.log(64 * MiB)
    return [int(math.exp(rng.uniform(low, high))) for _ in range(n)]


def one_pass(sizes: list[int], live: list) -> float:
    """Ns per pair over `sizes`, replacing the ring's oldest tensor each step."""
    import torch

    empty, uint8, device = torch.empty, torch.uint8, torch.device("cuda", 0)
    k = 0
    start = time.perf_counter_ns()
    for size in sizes:
        live[k] = None  # release first, then allocate: one pair
        live[k] = empty(size, dtype=uint8, device=device)
        k = k + 1 if k < RING - 1 else 0
    return (time.perf_counter_ns() - start) / len(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allocator", choices=("gpumem", "native"), required=True)
    parser.add_argument("--pairs", type=int, default=100_000, help="pairs per pass (default 100000)")
    parser.add_argument("--runs", type=int, default=5, help="timed passes (default 5)")
    parser.add_argument("--zero", action="store_true", help="0-byte tensors: the pair without the allocator's work")
    parser.add_argument("--out", default="", help="write the JSON result here too")
    args = parser.parse_args()
    select_allocator(args.allocator)
    check_allocator(args.allocator)
    import torch

    sizes = [0] * args.pairs if args.zero else log_uniform_sizes(args.pairs)
    live: list = [None] * RING
    one_pass(sizes, live)  # warm-up: the cache grows to what the workload needs
    allocs_before = torch.cuda.memory_stats().get("num_device_alloc", -1)
    gc.disable()  # a collection in the middle of a pass would be noise, not allocator cost
    runs = [one_pass(sizes, live) for _ in range(args.runs)]
    gc.enable()
    write_json(args.out, {
        "allocator": args.allocator, "pairs": args.pairs, "ring": RING, "zero": args.zero,
        "ns_per_pair": median(runs), "ns_per_pair_runs": runs,
        "device_allocs_while_timed": torch.cuda.memory_stats().get("num_device_alloc", -1) - allocs_before,
    })


if __name__ == "__main__":
    main()
