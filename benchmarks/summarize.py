#!/usr/bin/env python3
"""One run of benchmarks/run_all.sh as a Markdown section: the command, the machine and the date,
the rows missing from the run, the table (each figure, its target, met or missed), how to read it.

    python3 benchmarks/summarize.py OUTDIR   (docs/benchmarks.md: replace the section between the
                                             comments that mark summarize.py's output with it)

Reads the files run_all.sh writes into OUTDIR: command.txt, machine.json and each part's JSON. A row
with no file (its process failed, or the time budget skipped it) reads "not measured", pointing at
its log, and is named again on the "Not in this run" line. A measurement repeated in several
processes is NAME-1.json, NAME-2.json, ...; each row is computed from its own NAME's files only (so
"gpumem" never takes in "gpumem-plain"'s, nor "native" "native-expandable"'s), and shows the spread
over its processes. A part whose files cannot be read says so in its row.
"""
from __future__ import annotations

import json
import pathlib
import re
import statistics
import sys

GiB = 1 << 30
ROWS: list[tuple[str, ...]] = []
MISSING: list[str] = []


def row(part: str, figure: str, value: str, target: str = "-", verdict: str = "-") -> None:
    ROWS.append((part, figure, value, target, verdict))


def missing(part: str, figure: str, log: str) -> None:
    """A row run_all.sh measures that this run's files do not hold."""
    row(part, figure, f"not measured (see {log})")
    MISSING.append(f"part {part}, {figure} (see {log})")


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
# Part 8's cases as run_all.sh runs them: (streams, threads).
THREAD_CASES = [("own", t) for t in (1, 2, 4, 8, 16)] + [("shared", t) for t in (4, 8, 16)]


def at_most(value: float, bound: float) -> str:
    return f"met ({value:.3f} <= {bound})" if value <= bound else f"missed by {value - bound:.3f} ({value:.3f} > {bound})"


def at_least(value: float, bound: float) -> str:
    return f"met ({value:.3f} >= {bound})" if value >= bound else f"missed by {bound - value:.3f} ({value:.3f} < {bound})"


def allocator_cost(out: pathlib.Path) -> None:
    found = rounds(out, "allocators")
    if not found:
        return missing("1", "malloc+free pair through CUDAAllocator", "allocators-*.log")
    # Each process's figure is the median of its runs; the row is the median over the processes.
    by = {key: [r["subjects"][key]["ns_per_pair"] for r in found if key in r["subjects"]]
          for key in ("native", "gpumem", "cub", "cudaMalloc")}
    names = {"native": "PyTorch native (CUDAAllocator)", "gpumem": "gpumem (CUDAAllocator)",
             "cub": "CUB CachingDeviceAllocator", "cudaMalloc": "cudaMalloc + cudaFree"}
    native = statistics.median(by["native"]) if by["native"] else None
    for key, name in names.items():
        figure = f"malloc+free pair, {name}"
        if not by[key]:
            missing("1", figure, "allocators-*.log")
            continue
        ns = statistics.median(by[key])
        if key == "native":
            row("1", figure, f"{ns:.0f} ns ({spread(by[key], ' ns')})", verdict="baseline")
            continue
        if native is None:
            target, verdict = ((f"<= {PAIR_TARGET} x native", "not judged: native not measured") if key == "gpumem"
                               else ("-", "-"))
            row("1", figure, f"{ns:.0f} ns ({spread(by[key], ' ns')})", target, verdict)
            continue
        ratio = ns / native
        target, verdict = ((f"<= {PAIR_TARGET} x native", at_most(ratio, PAIR_TARGET)) if key == "gpumem"
                           else ("-", "-"))
        row("1", figure, f"{ns:.0f} ns ({ratio:.3f} x native; {spread(by[key], ' ns')})", target, verdict)


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
    cases = THREAD_CASES + sorted(set(by) - set(THREAD_CASES), key=lambda c: (c[0] != "own", c[1]))
    for streams, threads in cases:
        case = f"{threads} thread{'s' * (threads > 1)}, {streams} streams"
        if (streams, threads) not in by:
            missing("8", f"aggregate malloc+free pairs, {case}", "allocator-threads-*.log")
            continue
        rates = by[(streams, threads)]
        native, gpumem = statistics.median(rates["native"]), statistics.median(rates["gpumem"])
        row("8", f"aggregate malloc+free pairs, {case}, native (CUDAAllocator, {pairs} pairs a thread)",
            f"{rate(native)} ({rate_spread(rates['native'])})", verdict="baseline")
        bound = threads_target(streams, threads)
        row("8", f"aggregate malloc+free pairs, {case}, gpumem (CUDAAllocator, {pairs} pairs a thread)",
            f"{rate(gpumem)} ({gpumem / native:.3f} x native; {rate_spread(rates['gpumem'])})",
            f">= {bound:g} x native", at_least(gpumem / native, bound))


def threaded_workload(out: pathlib.Path) -> None:
    by = {a: rounds(out, f"threads-{a}") for a in ("native", "gpumem")}
    ops = {a: [r["ops_per_s"] for r in rs] for a, rs in by.items()}
    native = statistics.median(ops["native"]) if ops["native"] else None

    def shape(a: str) -> str:
        first = by[a][0]
        return f"{first['threads']} threads on their own streams, cap {first['cap'] / GiB:g} GiB"

    for a in ("native", "gpumem"):
        if not ops[a]:
            missing("9", f"multithreaded workload, {a}", f"threads-{a}-*.log")
            continue
        figure, mid = f"multithreaded workload, {a} ({shape(a)})", statistics.median(ops[a])
        if a == "native":
            row("9", figure, f"{mid:.0f} ops/s ({spread(ops[a], ' ops/s')})", verdict="baseline")
        elif native is None:
            row("9", figure, f"{mid:.0f} ops/s ({spread(ops[a], ' ops/s')})", f">= {WORKLOAD_TARGET:g} x native",
                "not judged: native not measured")
        else:
            row("9", figure, f"{mid:.0f} ops/s ({mid / native:.3f} x native; {spread(ops[a], ' ops/s')})",
                f">= {WORKLOAD_TARGET:g} x native", at_least(mid / native, WORKLOAD_TARGET))
    no_allocator_row("9", "multithreaded workload with no allocator work (views of one buffer a thread), native",
                     [r["ops_per_s"] for r in rounds(out, "threads-native-noalloc")], "threads-native-noalloc-*.log",
                     native, "ops/s", " ops/s", "the ceiling")
    figure = "multithreaded workload, highest peak reserved over the processes: gpumem / native"
    if not all(by.values()):
        return missing("9", figure, "threads-*.log")
    peaks = {a: max(r["peak_reserved"] for r in rs) for a, rs in by.items()}
    limit = max(r["limit"] for r in by["gpumem"])
    passed = sum(not r["cap_held"] for r in by["gpumem"])
    verdict = f"missed: passed it in {passed} of {len(by['gpumem'])} processes" if passed else "met"
    row("9", figure, f"{peaks['gpumem'] / GiB:.3f} / {peaks['native'] / GiB:.3f} GiB (gpumem's limit {limit / GiB:.3f} GiB)",
        "gpumem <= its limit", verdict)


def no_allocator_row(part: str, figure: str, runs: list, log: str, native, unit: str, spread_unit: str,
                     bound: str) -> None:
    """A reference row: the same work with no allocator work, so what an allocator that cost
    nothing would give (part 2's floor, part 9's ceiling), against native where it was measured."""
    if not runs:
        return missing(part, figure, log)
    mid = statistics.median(runs)
    if native is None:
        return row(part, figure, f"{mid:.0f} {unit} ({spread(runs, spread_unit)})")
    row(part, figure, f"{mid:.0f} {unit} ({mid / native:.3f} x native; {spread(runs, spread_unit)})", "-",
        f"{bound}: an allocator that cost nothing would give {mid / native:.3f} x native")


def torch_empty(out: pathlib.Path) -> None:
    by = {a: [r["ns_per_pair"] for r in rounds(out, f"torch_empty-{a}")] for a in ("native", "gpumem")}
    zero = [r["ns_per_pair"] for r in rounds(out, "torch_empty-native-zero")]
    native = statistics.median(by["native"]) if by["native"] else None
    if native is None:
        missing("2", "torch.empty + release, native", "torch_empty-native-*.log")
    else:
        row("2", "torch.empty + release, native", f"{native:.0f} ns/pair ({spread(by['native'], ' ns')})",
            verdict="baseline")
    if not by["gpumem"]:
        missing("2", "torch.empty + release, gpumem", "torch_empty-gpumem-*.log")
    elif native is None:
        row("2", "torch.empty + release, gpumem",
            f"{statistics.median(by['gpumem']):.0f} ns/pair ({spread(by['gpumem'], ' ns')})",
            f"<= {EMPTY_TARGET} x native", "not judged: native not measured")
    else:
        gpumem = statistics.median(by["gpumem"])
        row("2", "torch.empty + release, gpumem",
            f"{gpumem:.0f} ns/pair ({gpumem / native:.3f} x native; {spread(by['gpumem'], ' ns')})",
            f"<= {EMPTY_TARGET} x native", at_most(gpumem / native, EMPTY_TARGET))
    no_allocator_row("2", "torch.empty + release of 0-byte tensors, native: torch's share, no allocator work", zero,
                     "torch_empty-native-zero-*.log", native, "ns/pair", " ns", "the floor")


TRAINING = ("gpumem", "gpumem-plain", "native", "native-expandable")


def training_step(out: pathlib.Path) -> None:
    runs = {a: rounds(out, f"training-step-{a}") for a in TRAINING}
    # Each process's figure is the median of its passes; the row is the median over the processes, as
    # in the other parts (a median over every pass of every process could lie outside their spread).
    per_step = {a: statistics.median(r["step_ms"] for r in rs) for a, rs in runs.items() if rs}
    for a in TRAINING:
        if a not in per_step:
            missing("3", f"step time, {a}", f"training-step-{a}-*.log")
            continue
        first = runs[a][0]
        shape = f"batch {first['batch']}, lengths {min(first['lengths'])}-{max(first['lengths'])}"
        row("3", f"step time, {a} ({shape})", f"{per_step[a]:.2f} ms ({spread([r['step_ms'] for r in runs[a]], ' ms', 2)})")
    figure = "throughput, gpumem / native (native step time / gpumem's)"
    if "gpumem" in per_step and "native" in per_step:
        throughput = per_step["native"] / per_step["gpumem"]
        row("3", figure, f"{throughput:.4f}", f">= {STEP_TARGET:.2f}", at_least(throughput, STEP_TARGET))
    else:
        missing("3", figure, "training-step-gpumem-*.log, training-step-native-*.log")
    ratios = {a: statistics.median(r["reserved_over_allocated"] for r in rs) for a, rs in runs.items() if rs}
    for a, ratio in ratios.items():
        peak = statistics.median(r["peak_allocated"] for r in runs[a]) / GiB
        target, verdict = "-", "-"
        if a == "gpumem" and "native-expandable" in ratios:
            bound = ratios["native-expandable"]
            target = f"< native-expandable ({bound:.4f})"
            verdict = f"met ({ratio:.4f} < {bound:.4f})" if ratio < bound else f"missed by {ratio - bound:.4f}"
        elif a == "gpumem":
            target, verdict = "< native-expandable", "not judged: native-expandable not measured"
        row("3", f"peak reserved / peak allocated, {a}",
            f"{ratio:.4f} (peak allocated {peak:.2f} GiB; {spread([r['reserved_over_allocated'] for r in runs[a]], '', 4)})",
            target, verdict)


def under_cap(out: pathlib.Path) -> None:
    reference = load(out, "training-reference.json")
    caps = {a: load(out, f"training-cap-{a}.json") for a in TRAINING}
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
        elif a == "gpumem":
            target, verdict = "= reference", "not judged: the reference not measured"
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
            figure = f"replay {name}, {kind} segments"
            if not r:
                missing("5", figure, "replay.log")
                continue
            ratio = r["min_limit_over_peak_allocated"]
            value = f"min limit {r['min_limit'] / GiB:.3f} GiB = {ratio:.3f} x peak allocated ({peak})"
            target, verdict = f"compare: original reserved = {original:.3f} x", "-"
            if kind == "growable":
                target = "<= 1.05 x peak allocated"
                verdict = at_most(ratio, 1.05)
            elif ratio < original:
                verdict = f"{(1 - ratio / original) * 100:.1f}% below the original's reserved"
            row("5", figure, value, target, verdict)


PARTS = (("1", allocator_cost), ("2", torch_empty), ("3", training_step), ("4", under_cap), ("5", replay),
         ("8", allocator_threads), ("9", threaded_workload))


def one_line(text: object, limit: int = 300) -> str:
    """A value from a file, safe to print inside Markdown code or a table: one line, bounded, no backticks."""
    text = " ".join(str(text).split()).replace("`", "'").replace("|", "/")
    return text if len(text) <= limit else text[:limit] + "..."


def command(out: pathlib.Path, argument: str) -> str:
    """How the run and this section were made: run_all.sh's command line, as it wrote it to command.txt."""
    summarize = f"`python3 benchmarks/summarize.py {one_line(argument)}`"
    path = out / "command.txt"
    if not path.is_file():
        return f"- **Command**: not recorded ({argument} has no command.txt); this section: {summarize}"
    return f"- **Command**: `{one_line(path.read_text(errors='replace'))}`, then {summarize}"


def machine(out: pathlib.Path) -> list[str]:
    """The machine, the software and the date, from machine.json."""
    try:
        found = load(out, "machine.json")
    except ValueError as error:
        return [f"- **Machine**: machine.json unreadable ({one_line(error, 100)})", "- **Date**: not recorded"]
    if not found or not isinstance(found[0], dict):
        return ["- **Machine**: not recorded (no machine.json; see machine.log)", "- **Date**: not recorded"]
    m = found[0]
    memory = m.get("gpu_memory")
    memory = f"{memory / GiB:.1f} GiB" if isinstance(memory, (int, float)) and memory > 0 else "memory unknown"
    lines = [f"- **Machine**: {one_line(m.get('gpu', 'GPU unknown'))} ({memory}), driver "
             f"{one_line(m.get('driver', 'unknown'))}, {one_line(m.get('cpus', '?'))} CPUs; torch "
             f"{one_line(m.get('torch', 'unknown'))}, CUDA {one_line(m.get('cuda', 'unknown'))}"]
    if "uncommitted" in str(m.get("gpumem_commit", "")):
        lines[0] += "; gpumem built from a tree with uncommitted changes"
    lines.append(f"- **Date**: {one_line(m['date'])}" if m.get("date") else "- **Date**: not recorded")
    return lines


HOW_TO_READ = """\
### How to read it

- **value**: the median over the processes that measured the row, then how many processes and
  their min, median and max. A process's own figure is the median of its runs (parts 1, 2, 8, 9)
  or passes (part 3). "x native" is gpumem's median over native's, from the same run.
- **target**: the goal in the table of measurements at the top of docs/benchmarks.md; "-" where
  the row has none.
- **verdict**: "met", or "missed by" how much, the value against its target. "baseline" marks
  native's row that ratios divide by, "reference" part 4's uncapped search; the floor (part 2,
  0-byte tensors) and the ceiling (part 9, no allocator work) say what an allocator that cost
  nothing would give.
- Each row is computed from its own processes' files only: gpumem's never takes in gpumem-plain's,
  native's never native-expandable's.
- "not measured" marks a row whose process failed or was skipped (no GPU, the time budget); its
  log is named, and the "Not in this run" line above lists every such row.
- Times depend on the machine and what else runs on it; the ratios compare two allocators timed
  in the same run, alternating."""


def summarize(out: pathlib.Path, argument: str) -> str:
    for part, measure in PARTS:
        try:
            measure(out)
        except (OSError, KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as error:
            # A file from a killed process or another version: say so in the table and go on.
            row(part, f"part {part}", f"unreadable results ({type(error).__name__}: {one_line(error, 100)})")
            MISSING.append(f"part {part} (its files are unreadable)")
    absent = "; ".join(MISSING) if MISSING else "nothing: every row run_all.sh measures is here"
    lines = ["## One run of run_all.sh", "", command(out, argument), *machine(out),
             f"- **Not in this run**: {absent}", "",
             "| # | figure | value | target | verdict |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(one_line(cell, 400) for cell in r) + " |" for r in ROWS]
    return "\n".join(lines) + "\n\n" + HOW_TO_READ


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = pathlib.Path(sys.argv[1])
    if not out.is_dir():
        sys.exit(f"summarize.py: {out} is not a directory of run_all.sh's results")
    print(summarize(out, sys.argv[1]))


if __name__ == "__main__":
    main()
