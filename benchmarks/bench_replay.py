#!/usr/bin/env python3
"""The smallest cap each shipped memory snapshot fits under, with growable and with plain segments,
against what the original run reserved.

Every snapshot in tests/python/data that gpumem can read is replayed through gpumem on its
simulated device: no GPU needed. The captures of real training runs (listed in captured.json,
recorded on an H200 with PyTorch's own allocator, plain segments, by tools/capture_snapshots.py)
are the ones that matter; the others come from tools/make_test_snapshots.py. For each:
  - peak allocated: the peak of live blocks in the trace (each request rounded to 512 bytes);
  - min limit, growable / plain: the smallest limit, to 1 MiB, gpumem replays the whole trace
    under (gpumem.replay.min_limit) with growable segments (2 MiB pages) and with plain ones, and
    its ratio to peak allocated;
  - original reserved: the peak reserved in the recorded run (from its segment events), and its
    ratio to peak allocated (what the recording allocator needed to serve the same requests);
  - gpumem reserved, no limit: gpumem's own peak reserved when the replay has no cap.
The top-level figures of each snapshot (min_limit, ...) are the growable ones, gpumem's default;
"plain" holds the same figures with plain segments.

    python3 benchmarks/bench_replay.py [--data tests/python/data] [--out FILE]

Prints a table, then the JSON record (also written to FILE).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

from common import log, write_json

DATA = pathlib.Path(__file__).resolve().parents[1] / "tests" / "python" / "data"
MiB = 1 << 20
KINDS = ("growable", "plain")


def measure_kind(snapshot, peak: int, kind: str) -> dict:
    from gpumem import replay

    found = replay.min_limit(snapshot, precision=MiB, segments=kind)
    free_run = replay.replay(snapshot, "none", segments=kind)
    return {
        "min_limit": found.limit,
        "min_limit_over_peak_allocated": found.ratio,
        "gpumem_peak_reserved_no_limit": free_run.peak_reserved,
        "gpumem_reserved_over_peak_allocated_no_limit": free_run.peak_reserved / peak,
        "replays": found.replays,
    }


def measure(snapshot, captured: dict) -> dict:
    from gpumem import replay

    start = time.perf_counter()
    peak = replay.peak_allocated_from_trace(snapshot)
    growable, plain = (measure_kind(snapshot, peak, kind) for kind in KINDS)
    original = replay.replay(snapshot, "none").original_peak_reserved  # the recording's, whatever the kind
    return {
        "peak_allocated": peak,
        **growable,
        "plain": plain,
        "original_peak_reserved": original,
        "original_reserved_over_peak_allocated": original / peak,
        "torch_max_memory_allocated": captured.get("torch_max_memory_allocated"),
        "torch_max_memory_reserved": captured.get("torch_max_memory_reserved"),
        "recorded_on": f"{captured['device']}, torch {captured['torch_version']}" if captured else "synthetic",
        "seconds": time.perf_counter() - start,
    }


def readable(path: pathlib.Path):
    """The snapshot at `path`, or None (with a log line) when gpumem refuses it."""
    from gpumem.snapshot_file import SnapshotError, load

    try:
        return load(path)
    except SnapshotError as error:
        log(f"skipped {path.name}: {error}")
        return None


def table(snapshots: dict) -> str:
    def ratio(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    header = ("snapshot", "min limit / peak allocated, growable", "plain", "original reserved / peak allocated",
              "recorded on")
    rows = [header] + [(name, ratio(s["min_limit_over_peak_allocated"]),
                        ratio(s["plain"]["min_limit_over_peak_allocated"]),
                        ratio(s["original_reserved_over_peak_allocated"]), s["recorded_on"])
                       for name, s in snapshots.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]

    def aligned(row) -> str:  # names left, figures right
        figures = (cell.rjust(width) for cell, width in zip(row[1:-1], widths[1:-1]))
        return "  ".join((row[0].ljust(widths[0]), *figures, row[-1]))

    return "\n".join(aligned(row) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DATA)
    parser.add_argument("--out", default="", help="write the JSON result here too")
    args = parser.parse_args()
    captured_path = args.data / "captured.json"
    captured = json.loads(captured_path.read_text()) if captured_path.exists() else {}
    snapshots = {}
    for path in sorted(args.data.glob("*.pickle")):
        snapshot = readable(path)
        if snapshot is None:
            continue
        log(f"replay: {path.stem}")
        snapshots[path.stem] = measure(snapshot, captured.get(path.stem, {}))
    print(table(snapshots) + "\n")
    from gpumem.replay import PAGE_SIZE

    write_json(args.out, {"precision": MiB, "page_size": PAGE_SIZE, "snapshots": snapshots})


if __name__ == "__main__":
    main()
