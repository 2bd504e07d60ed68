#!/usr/bin/env python3
"""A job that ramps up to many live blocks on the GPU: time per allocation as the live blocks
grow, gpumem against native, one process per allocator and ramp.

Each ramp allocates uint8 tensors of one size with torch.empty and frees none, timing every slice
of `--slice` allocations (default 10,000). An allocator whose cost grows with the live blocks
shows it as a rising time per allocation from slice to slice (a cost linear in the live blocks,
as gpumem's walk over every block at each growth past the high mark was, doubles it from the
5th slice to the 10th); a flat row is a constant cost. The ramps (`--ramps`, default both):
  - small: 100,000 blocks of 1 MiB, 97.7 GiB. 1 MiB is the largest small-pool request: gpumem
    maps a 2 MiB page every second block, native makes a 2 MiB segment every second block.
  - large: 60,000 blocks of 2 MiB, 117.2 GiB, the trace of the issue (never-freed 2 MiB
    allocations): every block is one new page for gpumem, native cuts 20 MiB segments in ten.
    100,000 large-pool blocks do not fit a 140 GiB H200 under gpumem: a request of just over
    1 MiB (a large-pool one) takes a whole 2 MiB page, since the remainder of 1 MiB or less is
    kept in the block rather than split off (as native keeps it), so 100,000 of them need 195 GiB.
Each process runs one allocator (benchmarks/common.py: gpumem is gpumem.enable()'d with growable
segments, its default on a GPU; native is PyTorch's own) and one ramp, under a time limit; the
whole stays within --budget seconds (default 220). Without a CUDA GPU it says so and exits 0,
measuring nothing.

    python3 benchmarks/bench_ramp.py [--ramps small large] [--slice 10000] [--out FILE]
    python3 benchmarks/bench_ramp.py --child ALLOCATOR RAMP       (one process's run; prints JSON)

Prints a table per ramp (microseconds per allocation, slice by slice, each allocator; the last
slice over the first), then the JSON record (also written to FILE).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

from common import log, write_json

MiB, GiB = 1 << 20, 1 << 30
RAMPS = {"small": (100_000, 1 * MiB), "large": (60_000, 2 * MiB)}  # blocks, bytes each
ALLOCATORS = ("gpumem", "native")
CHILD_LIMIT_S = 100


def ramp(blocks: int, size: int, slice_len: int) -> dict:
    """Allocates `blocks` tensors of `size` bytes, none freed; the ns per allocation of each slice."""
    import torch

    empty, uint8, device = torch.empty, torch.uint8, torch.device("cuda", 0)
    live = []
    slices = []
    gc.disable()  # a collection over the growing list would be noise, not allocator cost
    for start in range(0, blocks, slice_len):
        count = min(slice_len, blocks - start)
        began = time.perf_counter_ns()
        for _ in range(count):
            live.append(empty(size, dtype=uint8, device=device))
        slices.append((time.perf_counter_ns() - began) / count)
    gc.enable()
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    return {"blocks": blocks, "size": size, "slice": slice_len, "ns_per_alloc": slices,
            "allocated_bytes": stats.get("allocated_bytes.all.current", 0),
            "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
            "device_allocs": stats.get("num_device_alloc", 0)}


def child(allocator: str, ramp_name: str, slice_len: int) -> None:
    from common import check_allocator, select_allocator

    select_allocator(allocator)
    check_allocator(allocator)
    blocks, size = RAMPS[ramp_name]
    import torch

    result = {"allocator": allocator, "ramp": ramp_name, "device": torch.cuda.get_device_name(0),
              **ramp(blocks, size, slice_len)}
    print(json.dumps(result), flush=True)
    os._exit(0)  # the blocks go with the process: freeing 100,000 tensors one by one measures nothing


def run_child(allocator: str, ramp_name: str, slice_len: int, limit: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", allocator, ramp_name, "--slice", str(slice_len)]
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMEM_LIMIT", "PYTORCH_CUDA_ALLOC_CONF")}
    log(f"ramp {ramp_name}: {allocator} (at most {limit:.0f} s)")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {"allocator": allocator, "ramp": ramp_name, "error": f"over its time limit of {limit:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"allocator": allocator, "ramp": ramp_name, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def table(ramp_name: str, runs: dict) -> str:
    blocks, size = RAMPS[ramp_name]
    lines = [f"ramp {ramp_name}: {blocks:,} blocks of {size / MiB:g} MiB, none freed; us per allocation by slice"]
    measured = {a: r for a, r in runs.items() if "ns_per_alloc" in r}
    for a, r in runs.items():
        if a not in measured:
            lines.append(f"  {a}: not measured ({r['error']})")
    if not measured:
        return "\n".join(lines)
    slice_len = next(iter(measured.values()))["slice"]
    names = list(measured)
    lines.append("  " + "live blocks".ljust(18) + "".join(a.rjust(12) for a in names))
    count = max(len(r["ns_per_alloc"]) for r in measured.values())
    for i in range(count):
        first, last = i * slice_len, min((i + 1) * slice_len, blocks)
        cells = "".join((f"{measured[a]['ns_per_alloc'][i] / 1000:.2f}" if i < len(measured[a]["ns_per_alloc"])
                         else "-").rjust(12) for a in names)
        lines.append("  " + f"{first:,}-{last:,}".ljust(18) + cells)
    lines.append("  " + "last / first".ljust(18) +
                 "".join(f"{r['ns_per_alloc'][-1] / r['ns_per_alloc'][0]:.2f}".rjust(12) for r in measured.values()))
    lines.append("  " + "reserved GiB".ljust(18) +
                 "".join(f"{r['reserved_bytes'] / GiB:.1f}".rjust(12) for r in measured.values()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ramps", nargs="+", choices=sorted(RAMPS), default=list(RAMPS))
    parser.add_argument("--slice", type=int, default=10_000, help="allocations per timed slice (default 10000)")
    parser.add_argument("--budget", type=float, default=220, help="seconds for the whole run (default 220)")
    parser.add_argument("--out", default="", help="write the JSON result here too")
    parser.add_argument("--child", nargs=2, metavar=("ALLOCATOR", "RAMP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.slice < 1:
        parser.error("--slice: at least 1 allocation")
    if args.child:
        allocator, ramp_name = args.child
        if allocator not in ALLOCATORS or ramp_name not in RAMPS:
            parser.error(f"--child: one of {ALLOCATORS} and one of {sorted(RAMPS)}")
        return child(allocator, ramp_name, args.slice)
    import torch

    if not torch.cuda.is_available():
        print("bench_ramp: no CUDA GPU here; nothing measured")
        return
    started = time.monotonic()
    results: dict = {}
    for ramp_name in args.ramps:
        results[ramp_name] = {}
        for allocator in ALLOCATORS:
            left = args.budget - (time.monotonic() - started)
            if left < 20:
                results[ramp_name][allocator] = {"allocator": allocator, "ramp": ramp_name,
                                                 "error": "the time budget is spent"}
                continue
            results[ramp_name][allocator] = run_child(allocator, ramp_name, args.slice, min(CHILD_LIMIT_S, left))
    for ramp_name, runs in results.items():
        print(table(ramp_name, runs) + "\n")
    write_json(args.out, {"ramps": results, "seconds": time.monotonic() - started})


if __name__ == "__main__":
    main()
