#!/usr/bin/env python3
"""The smallest cap each shipped memory snapshot fits under, against what the original run reserved.

The snapshots in tests/python/data that are captures of real training runs (those listed in
captured.json, recorded on an H200 with PyTorch's own allocator by tools/capture_snapshots.py)
are replayed through gpumem on its simulated device: no GPU needed. For each:
  - peak allocated: the peak of live blocks in the trace (each request rounded to 512 bytes);
  - min limit: the smallest limit, to 1 MiB, gpumem replays the whole trace under
    (gpumem.replay.min_limit), and its ratio to peak allocated;
  - original reserved: the peak reserved by PyTorch's allocator in the recorded run, and its
    ratio to peak allocated (what native needed to serve the same requests);
  - gpumem reserved, no limit: gpumem's own peak reserved when the replay has no cap.

    python3 benchmarks/bench_replay.py [--data tests/python/data] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

from common import log, write_json

DATA = pathlib.Path(__file__).resolve().parents[1] / "tests" / "python" / "data"
MiB = 1 << 20


def measure(path: pathlib.Path, captured: dict) -> dict:
    from gpumem import replay

    start = time.perf_counter()
    peak = replay.peak_allocated_from_trace(str(path))
    found = replay.min_limit(str(path), precision=MiB)
    free_run = replay.replay(str(path), "none")
    return {
        "peak_allocated": peak,
        "min_limit": found.limit,
        "min_limit_over_peak_allocated": found.ratio,
        "original_peak_reserved": free_run.original_peak_reserved,
        "original_reserved_over_peak_allocated": free_run.original_peak_reserved / peak,
        "gpumem_peak_reserved_no_limit": free_run.peak_reserved,
        "gpumem_reserved_over_peak_allocated_no_limit": free_run.peak_reserved / peak,
        "torch_max_memory_allocated": captured.get("torch_max_memory_allocated"),
        "torch_max_memory_reserved": captured.get("torch_max_memory_reserved"),
        "recorded_on": f"{captured.get('device')}, torch {captured.get('torch_version')}",
        "replays": found.replays,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DATA)
    parser.add_argument("--out", default="", help="write the JSON result here too")
    args = parser.parse_args()
    captured = json.loads((args.data / "captured.json").read_text())
    snapshots = {}
    for name in sorted(captured):
        log(f"replay: {name}")
        snapshots[name] = measure(args.data / f"{name}.pickle", captured[name])
    write_json(args.out, {"precision": MiB, "snapshots": snapshots})


if __name__ == "__main__":
    main()
