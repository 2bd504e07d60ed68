#!/usr/bin/env python3
"""The Markdown table of benchmarks/run_all.sh's results: each figure, its target, met or missed.

    python3 benchmarks/summarize.py OUTDIR        (prints the table; paste it into docs/benchmarks.md)

Reads the JSON files run_all.sh writes into OUTDIR; a part with no file is reported as not
measured, pointing at its log. A measurement repeated in several processes is NAME-1.json,
NAME-2.json, ...; each row is computed from its own NAME's files only (so "gpumem" never takes in
"gpumem-plain"'s, nor "native" "native-expandable"'s), and shows the spread over its processes.
"""
from __future__ import annotations

import json
import pathlib
import re
import statistics
import sys

GiB = 1 << 30
ROWS: list[tuple[str, ...]] = []


def row(part: str, figure: str, value: str, target: str = "-", verdict: str = "-") -> None:
    ROWS.append((part, figure, value, target, verdict))


def load(out: pathlib.Path, name: str) -> list[dict]:
    """The result in OUTDIR/NAME, as a list of one, or none."""
    path = out / name
    return [json.loads(path.read_text())] if path.is_file() else []


def rounds(out: pathlib.Path, name: str) -> list[dict]:
    """The results of NAME's processes, NAME-1.json, NAME-2.json, ... in round order: that name
    exactly, never a longer one that starts with it (training-step-gpumem-plain-1.json is not
    training-step-gpumem's)."""
    own = re.compile(re.escape(name) + r"-([0-9]+)\.json")
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := own.fullmatch(p.name))]
    return [json.loads(p.read_text()) for _, p in sorted(found)]


def spread(values: list[float], unit: str = "", digits: int = 0) -> str:
    """min / median / max over the processes, or the one value."""
    def shown(v: float) -> str:
        return f"{v:.{digits}f}{unit}"

    if len(values) == 1:
        return f"1 process: {shown(values[0])}"
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{len(values)} processes: min {shown(low)}, median {shown(mid)}, max {shown(high)}"


# The goals the project holds gpumem to (docs/benchmarks.md's table of measurements): part 1's pair
# and part 2's torch.empty at most these fractions of native's time, part 3's throughput and part
# 9's operations per second at least these multiples of native's (part 8's: threads_target).
PAIR_TARGET = 0.33
EMPTY_TARGET = 0.6
STEP_TARGET = 1.0
WORKLOAD_TARGET = 1.1


def at_most(value: float, bound: float) -> str:
    return f"met ({value:.3f} <= {bound})" if value <= bound else f"missed by {value - bound:.3f} ({value:.3f} > {bound})"


def at_least(value: float, bound: float) -> str:
    return f"met ({value:.3f} >= {bound})" if value >= bound else f"missed by {bound - value:.3f} ({value:.3f} < {bound})"


def missing(part: str, figure: str, log: str) -> None:
    row(part, figure, f"not measured (see {log})")


def allocator_cost(out: pathlib.Path) -> None:
    found = rounds(out, "allocators")
    if not found:
        return missing("1", "malloc+free pair through CUDAAllocator", "allocators-*.log")
    # Each process's figure is the median of its runs; the row is the median over the processes.
    by = {key: [r["subjects"][key]["ns_per_pair"] for r in found if key in r["subjects"]]
          for key in ("native", "gpumem", "cub", "cudaMalloc")}
    native = statistics.median(by["native"])
    row("1", "malloc+free pair, PyTorch native (CUDAAllocator)", f"{native:.0f} ns ({spread(by['native'], ' ns')})",
        verdict="baseline")
    names = {"gpumem": "gpumem (CUDAAllocator)", "cub": "CUB CachingDeviceAllocator", "cudaMalloc": "cudaMalloc + cudaFree"}
    for key, name in names.items():
        if not by[key]:
            continue
        ns = statistics.median(by[key])
        ratio = ns / native
        target, verdict = ((f"<= {PAIR_TARGET} x native", at_most(ratio, PAIR_TARGET)) if key == "gpumem"
                           else ("-", "-"))
        row("1", f"malloc+free pair, {name}", f"{ns:.0f} ns ({ratio:.3f} x native; {spread(by[key], ' ns')})",
            target, verdict)


def rate(value: float) -> str:
    return f"{value / 1e6:.3f} M/s"


def rate_spread(values: list[float]) -> str:
    """min / median / max over the processes, or the one value, in M/s."""
    return spread([v / 1e6 for v in values], " M/s", 3)


def threads_target(streams: str, threads: int) -> float:
    """gpumem's aggregate rate over native's, at least: 2 with 8 threads on their own streams, else 1."""
    return 2.0 if (streams, threads) == ("own", 8) else 1.0


def allocator_threads(out: pathlib.Path) -> None:
    found = rounds(out, "allocator-threads")
    if not found:
        return missing("8", "malloc+free pairs from many threads through CUDAAllocator", "allocator-threads-*.log")
    # Each process's figure per case is the median of its runs; a row is the median over the processes.
    by: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in found:
        for case in r["cases"]:
            rates = by.setdefault((case["streams"], case["threads"]), {"native": [], "gpumem": []})
            for key, values in rates.items():
                values.append(case["subjects"][key]["pairs_per_s"])
    pairs = found[0]["pairs_per_thread"]
    for (streams, threads), rates in sorted(by.items(), key=lambda item: (item[0][0] != "own", item[0][1])):
        case = f"{threads} thread{'s' * (threads > 1)}, {streams} streams"
        native, gpumem = statistics.median(rates["native"]), statistics.median(rates["gpumem"])
        row("8", f"aggregate malloc+free pairs, {case}, native (CUDAAllocator, {pairs} pairs a thread)",
            f"{rate(native)} ({rate_spread(rates['native'])})", verdict="baseline")
        bound = threads_target(streams, threads)
        row("8", f"aggregate malloc+free pairs, {case}, gpumem (CUDAAllocator, {pairs} pairs a thread)",
            f"{rate(gpumem)} ({gpumem / native:.3f} x native; {rate_spread(rates['gpumem'])})",
            f">= {bound:g} x native", at_least(gpumem / native, bound))


def threaded_workload(out: pathlib.Path) -> None:
    by = {a: rounds(out, f"threads-{a}") for a in ("gpumem", "native")}
    if not all(by.values()):
        return missing("9", "multithreaded workload", "threads-*.log")
    ops = {a: [r["ops_per_s"] for r in rs] for a, rs in by.items()}
    native, gpumem = statistics.median(ops["native"]), statistics.median(ops["gpumem"])

    def shape(a: str) -> str:
        first = by[a][0]
        return f"{first['threads']} threads on their own streams, cap {first['cap'] / GiB:g} GiB"

    row("9", f"multithreaded workload, native ({shape('native')})",
        f"{native:.0f} ops/s ({spread(ops['native'], ' ops/s')})", verdict="baseline")
    row("9", f"multithreaded workload, gpumem ({shape('gpumem')})",
        f"{gpumem:.0f} ops/s ({gpumem / native:.3f} x native; {spread(ops['gpumem'], ' ops/s')})",
        f">= {WORKLOAD_TARGET:g} x native", at_least(gpumem / native, WORKLOAD_TARGET))
    ceiling_runs = [r["ops_per_s"] for r in rounds(out, "threads-native-noalloc")]
    if ceiling_runs:
        ceiling = statistics.median(ceiling_runs)
        row("9", "multithreaded workload with no allocator work (views of one buffer a thread), native",
            f"{ceiling:.0f} ops/s ({ceiling / native:.3f} x native; {spread(ceiling_runs, ' ops/s')})", "-",
            f"the ceiling: an allocator that cost nothing would give {ceiling / native:.3f} x native")
    peaks = {a: max(r["peak_reserved"] for r in rs) for a, rs in by.items()}
    limit = max(r["limit"] for r in by["gpumem"])
    passed = sum(not r["cap_held"] for r in by["gpumem"])
    verdict = f"missed: passed it in {passed} of {len(by['gpumem'])} processes" if passed else "met"
    row("9", "multithreaded workload, highest peak reserved over the processes: gpumem / native",
        f"{peaks['gpumem'] / GiB:.3f} / {peaks['native'] / GiB:.3f} GiB (gpumem's limit {limit / GiB:.3f} GiB)",
        "gpumem <= its limit", verdict)


def torch_empty(out: pathlib.Path) -> None:
    by = {a: [r["ns_per_pair"] for r in rounds(out, f"torch_empty-{a}")] for a in ("gpumem", "native")}
    if not all(by.values()):
        return missing("2", "torch.empty + release", "torch_empty-*.log")
    gpumem, native = statistics.median(by["gpumem"]), statistics.median(by["native"])
    row("2", "torch.empty + release, native", f"{native:.0f} ns/pair ({spread(by['native'], ' ns')})",
        verdict="baseline")
    row("2", "torch.empty + release, gpumem",
        f"{gpumem:.0f} ns/pair ({gpumem / native:.3f} x native; {spread(by['gpumem'], ' ns')})",
        f"<= {EMPTY_TARGET} x native", at_most(gpumem / native, EMPTY_TARGET))
    zero = [r["ns_per_pair"] for r in rounds(out, "torch_empty-native-zero")]
    if zero:
        floor = statistics.median(zero)
        row("2", "torch.empty + release of 0-byte tensors, native: torch's share, no allocator work",
            f"{floor:.0f} ns/pair ({floor / native:.3f} x native; {spread(zero, ' ns')})", "-",
            f"the floor: an allocator that cost nothing would give {floor / native:.3f} x native")


def training_step(out: pathlib.Path) -> None:
    runs = {a: rounds(out, f"training-step-{a}") for a in ("gpumem", "gpumem-plain", "native", "native-expandable")}
    if not (runs["gpumem"] and runs["native"]):
        return missing("3", "training step", "training-step-*.log")
    # Each process's figure is the median of its passes; the row is the median over the processes, as
    # in the other parts (a median over every pass of every process could lie outside their spread).
    per_step = {a: statistics.median(r["step_ms"] for r in rs) for a, rs in runs.items() if rs}
    first = runs["gpumem"][0]
    shape = f"batch {first['batch']}, lengths {min(first['lengths'])}-{max(first['lengths'])}"
    for a, ms in per_step.items():
        row("3", f"step time, {a} ({shape})", f"{ms:.2f} ms ({spread([r['step_ms'] for r in runs[a]], ' ms', 2)})")
    throughput = per_step["native"] / per_step["gpumem"]
    row("3", "throughput, gpumem / native (native step time / gpumem's)", f"{throughput:.4f}",
        f">= {STEP_TARGET:.2f}", at_least(throughput, STEP_TARGET))
    ratios = {a: statistics.median(r["reserved_over_allocated"] for r in rs) for a, rs in runs.items() if rs}
    for a, ratio in ratios.items():
        peak = statistics.median(r["peak_allocated"] for r in runs[a]) / GiB
        target, verdict = "-", "-"
        if a == "gpumem" and "native-expandable" in ratios:
            bound = ratios["native-expandable"]
            target = f"< native-expandable ({bound:.4f})"
            verdict = f"met ({ratio:.4f} < {bound:.4f})" if ratio < bound else f"missed by {ratio - bound:.4f}"
        row("3", f"peak reserved / peak allocated, {a}",
            f"{ratio:.4f} (peak allocated {peak:.2f} GiB; {spread([r['reserved_over_allocated'] for r in runs[a]], '', 4)})",
            target, verdict)


def under_cap(out: pathlib.Path) -> None:
    reference = load(out, "training-reference.json")
    caps = {a: load(out, f"training-cap-{a}.json") for a in ("gpumem", "gpumem-plain", "native", "native-expandable")}
    if reference:
        ref = reference[0]
        row("4", f"largest batch whose peak allocated fits under {ref['cap'] / GiB:g} GiB (uncapped run)",
            str(ref["largest_batch"]), verdict="reference")
    else:
        missing("4", "reference batch", "training-reference.log")
    for a, found in caps.items():
        if not found:
            missing("4", f"largest batch under the cap, {a}", f"training-cap-{a}.log")
            continue
        r = found[0]
        how = "gpumem.set_limit" if a.startswith("gpumem") else "set_per_process_memory_fraction"
        failure = r.get("failure") or {}
        value = f"{r['largest_batch']} (batch {failure.get('batch', '?')} failed: {failure.get('verdict', 'no failure')})"
        if not r.get("cap_held", True):
            value = f"{r['largest_batch']} (the cap did not hold: peak reserved passed it)"
        target, verdict = "-", "-"
        if a == "gpumem" and reference:
            best = reference[0]["largest_batch"]
            target = f"= reference ({best})"
            verdict = "met" if r["largest_batch"] >= best else f"missed by {best - r['largest_batch']} batch(es)"
        row("4", f"largest batch at length {r['length']} under the cap, {a} ({how})", value, target, verdict)


def replay(out: pathlib.Path) -> None:
    found = load(out, "replay.json")
    if not found:
        return missing("5", "replay of the shipped snapshots", "replay.log")
    for name, s in found[0]["snapshots"].items():
        if s.get("recorded_on") == "synthetic":
            continue  # the figures are about real runs; the synthetic traces are for tests
        original = s["original_reserved_over_peak_allocated"]
        peak = f"peak allocated {s['peak_allocated'] / GiB:.3f} GiB"
        for kind, r in (("growable", s), ("plain", s.get("plain"))):
            if not r:
                continue
            ratio = r["min_limit_over_peak_allocated"]
            value = f"min limit {r['min_limit'] / GiB:.3f} GiB = {ratio:.3f} x peak allocated ({peak})"
            target, verdict = f"compare: original reserved = {original:.3f} x", "-"
            if kind == "growable":
                target = "<= 1.05 x peak allocated"
                verdict = at_most(ratio, 1.05)
            elif ratio < original:
                verdict = f"{(1 - ratio / original) * 100:.1f}% below the original's reserved"
            row("5", f"replay {name}, {kind} segments", value, target, verdict)


def machine(out: pathlib.Path) -> str:
    found = load(out, "machine.json")
    if not found:
        return "Machine: not recorded."
    m = found[0]
    return (f"Machine: {m['gpu']} ({m['gpu_memory'] / GiB:.1f} GiB, driver {m['driver']}), {m['cpus']} CPUs; "
            f"torch {m['torch']} (CUDA {m['cuda']}); gpumem {m['gpumem_commit']}; {m['date']}.")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = pathlib.Path(sys.argv[1])
    if not out.is_dir():
        sys.exit(f"summarize.py: {out} is not a directory of run_all.sh's results")
    parts = (allocator_cost, torch_empty, training_step, under_cap, replay, allocator_threads, threaded_workload)
    for part in parts:
        part(out)
    print(machine(out) + "\n")
    print("| # | figure | value | target | verdict |\n|---|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
