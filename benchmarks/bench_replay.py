#!/usr/bin/env python3
"""The smallest cap each shipped memory snapshot fits under, with growable and with plain segments,
against what the original run reserved.

Every snapshot in tests/python/data that gpumem can read is replayed through gpumem on its
simulated device: no GPU needed. The captures of real training runs (listed in captured.json,
recorded on an H200 with PyTorch's own allocator, plain segments, by tools/capture_snapshots.py)
are the ones that matter; the others come from tools/make_test_snapshots.py. For each:
  - peak allocated: the peak of live blocks in the trace (each request rounded to 512 bytes);
  - min limit, growable / plain: the smallest limit, to 1 MiB, gpumem replays the whole trace
    under (gpumem.replay.min_limit) with growable segments (2 MiB pages; the chunks --chunk sets)
    and with plain ones, and
    its ratio to peak allocated;
  - original reserved: the peak reserved in the recorded run (from its segment events), and its
    ratio to peak allocated (what the recording allocator needed to serve the same requests);
  - gpumem reserved, no limit: gpumem's own peak reserved when the replay has no cap.
The top-level figures of each snapshot (min_limit, ...) are the growable ones, gpumem's default;
"plain" holds the same figures with plain segments.

    python3 benchmarks/bench_replay.py [--data tests/python/data] [--out FILE] [--chunk 16MB]

--chunk replays growable segments with that least chunk for the large pool (GPUMEM_CHUNK's forms):
what a coarser chunk costs the cap.

Prints a table, then the JSON record (also written to FILE).

With --scaling, it measures instead how replay time grows with the trace's length: for each
length (10,000, 100,000 and 1,000,000 events unless given), synthetic traces of two shapes are
written as snapshot files and replayed with no limit, growable segments, one process:
  - ramp: that many 2 MiB allocations, none freed (each one grows reserved past its high mark);
  - churn: allocations of 512 B to 64 MiB (log-uniform, fixed seed) and frees of random live
    blocks, about 1,000 live, half the events each (frees of large blocks leave free pages that
    later growths recycle).
For each it prints the seconds to load the file (gpumem.snapshot_file.load) and to replay it
(gpumem.replay.replay), their sum per event, and that figure over the shortest trace's; then the
process's CPU seconds for each part, which other processes on the machine do not inflate.

    python3 benchmarks/bench_replay.py --scaling [LENGTH ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import pickle
import random
import tempfile
import time

from common import log, write_json

DATA = pathlib.Path(__file__).resolve().parents[1] / "tests" / "python" / "data"
MiB = 1 << 20
KINDS = ("growable", "plain")
SCALING_LENGTHS = (10_000, 100_000, 1_000_000)
SHAPES = ("ramp", "churn")
BASE_ADDRESS = 0x7F00_0000_0000


def measure_kind(snapshot, peak: int, kind: str, chunk: int = 0) -> dict:
    from gpumem.trace import replay

    found = replay.min_limit(snapshot, precision=MiB, segments=kind, chunk=chunk)
    free_run = replay.replay(snapshot, "none", segments=kind, chunk=chunk)
    return {
        "min_limit": found.limit,
        "min_limit_over_peak_allocated": found.ratio,
        "gpumem_peak_reserved_no_limit": free_run.peak_reserved,
        "gpumem_reserved_over_peak_allocated_no_limit": free_run.peak_reserved / peak,
        "replays": found.replays,
    }


def measure(snapshot, captured: dict, chunk: int = 0) -> dict:
    from gpumem.trace import replay

    start = time.perf_counter()
    peak = replay.peak_allocated_from_trace(snapshot)
    growable, plain = (measure_kind(snapshot, peak, kind, chunk) for kind in KINDS)
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
    from gpumem.trace.snapshot_file import SnapshotError, load

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


# ---- --scaling: replay time against trace length ----------------------------------------------


def ramp_events(length: int) -> list[dict]:
    return [{"action": "alloc", "addr": BASE_ADDRESS + i * 2 * MiB, "size": 2 * MiB, "stream": 0, "time_us": i}
            for i in range(length)]


def churn_events(length: int, live_target: int = 1000, seed: int = 25) -> list[dict]:
    rng = random.Random(seed)
    live: list[tuple[int, int]] = []  # (address, size)
    events, next_addr = [], BASE_ADDRESS
    for i in range(length):
        if live and (len(live) >= 2 * live_target or (len(live) > live_target // 2 and rng.random() < 0.5)):
            addr, size = live.pop(rng.randrange(len(live)))
            events.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0, "time_us": i})
            continue
        size = int(2 ** rng.uniform(9, 26)) // 512 * 512
        live.append((next_addr, size))
        events.append({"action": "alloc", "addr": next_addr, "size": size, "stream": 0, "time_us": i})
        next_addr += -(-size // MiB) * MiB
    return events


def scaling_run(shape: str, length: int, directory: pathlib.Path) -> dict:
    from gpumem.trace import replay
    from gpumem.trace.snapshot_file import load

    events = ramp_events(length) if shape == "ramp" else churn_events(length)
    path = directory / f"{shape}-{length}.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}, protocol=4))
    del events
    start, start_cpu = time.perf_counter(), time.process_time()
    snapshot = load(path)
    loaded, loaded_cpu = time.perf_counter(), time.process_time()
    result = replay.replay(snapshot, "none")
    done, done_cpu = time.perf_counter(), time.process_time()
    if not result.fits or result.allocs_replayed + result.frees_replayed != length:
        raise SystemExit(f"bench_replay: the {shape} trace of {length} events did not replay whole: {result.failure}")
    return {"events": length, "file_bytes": path.stat().st_size, "load_s": loaded - start,
            "replay_s": done - loaded, "total_s": done - start, "us_per_event": (done - start) / length * 1e6,
            "load_cpu_s": loaded_cpu - start_cpu, "replay_cpu_s": done_cpu - loaded_cpu,
            "total_cpu_s": done_cpu - start_cpu,
            "peak_reserved": result.peak_reserved, "peak_allocated": result.peak_allocated}


def scaling(lengths: list[int]) -> dict:
    runs: dict[str, list[dict]] = {shape: [] for shape in SHAPES}
    with tempfile.TemporaryDirectory(prefix="gpumem-bench-replay-") as tmp:
        for length in sorted(lengths):
            for shape in SHAPES:
                log(f"replay scaling: {shape}, {length} events")
                runs[shape].append(scaling_run(shape, length, pathlib.Path(tmp)))
    for shape_runs in runs.values():
        base = shape_runs[0]["us_per_event"]
        for r in shape_runs:
            r["per_event_over_shortest"] = r["us_per_event"] / base
    return runs


def scaling_table(runs: dict) -> str:
    header = ("trace", "events", "file", "load s", "replay s", "total s", "us / event", "x shortest",
              "CPU s: load", "replay", "total")
    rows = [header] + [(shape, f"{r['events']:,}", f"{r['file_bytes'] / MiB:.1f} MiB", f"{r['load_s']:.2f}",
                        f"{r['replay_s']:.2f}", f"{r['total_s']:.2f}", f"{r['us_per_event']:.2f}",
                        f"{r['per_event_over_shortest']:.2f}", f"{r['load_cpu_s']:.2f}", f"{r['replay_cpu_s']:.2f}",
                        f"{r['total_cpu_s']:.2f}")
                       for shape, shape_runs in runs.items() for r in shape_runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join((row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))))
                     for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DATA)
    parser.add_argument("--out", default="", help="write the JSON result here too")
    parser.add_argument("--chunk", default="0",
                        help="the least chunk of growable segments' large pool, as GPUMEM_CHUNK takes it (default 0: pages)")
    parser.add_argument("--scaling", type=int, nargs="*", metavar="LENGTH",
                        help="replay time against trace length instead (default lengths: 10000 100000 1000000)")
    args = parser.parse_args()
    from gpumem.settings.chunk import chunk_bytes

    try:
        chunk = chunk_bytes(args.chunk)
    except ValueError as error:
        parser.error(f"--chunk: {error}")
    if args.scaling is not None and chunk:
        parser.error("--chunk applies to the snapshots' replays, not to --scaling")
    if args.scaling is not None:
        lengths = args.scaling or list(SCALING_LENGTHS)
        if any(n < 1 for n in lengths):
            parser.error("--scaling: each length is a number of events, at least 1")
        runs = scaling(lengths)
        print(scaling_table(runs) + "\n")
        write_json(args.out, {"scaling": runs, "segments": "growable", "limit": "none"})
        return
    captured_path = args.data / "captured.json"
    captured = json.loads(captured_path.read_text()) if captured_path.exists() else {}
    snapshots = {}
    for path in sorted(args.data.glob("*.pickle")):
        snapshot = readable(path)
        if snapshot is None:
            continue
        log(f"replay: {path.stem}")
        snapshots[path.stem] = measure(snapshot, captured.get(path.stem, {}), chunk)
    print(table(snapshots) + "\n")
    from gpumem.trace.replay import PAGE_SIZE

    write_json(args.out, {"precision": MiB, "page_size": PAGE_SIZE, "chunk": chunk, "snapshots": snapshots})


if __name__ == "__main__":
    main()
