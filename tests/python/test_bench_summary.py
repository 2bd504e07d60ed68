"""benchmarks/summarize.py over planted result files: the section names the command, the machine,
the date and the rows missing from the run; each allocator's rows come from its own processes'
files only, and repeated measurements show their spread. CPU only."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

SUMMARIZE = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "summarize.py"
GiB = 1 << 30
LENGTHS = [64 * (i + 1) for i in range(16)]  # one pass: 16 steps

# Per allocator: step time in ms and peak reserved / peak allocated, set far apart so that a row
# taking in another allocator's files comes out different.
STEP_MS = {"gpumem": 28.0, "gpumem-plain": 29.0, "native": 30.0, "native-expandable": 31.0}
RATIO = {"gpumem": 1.1, "gpumem-plain": 1.5, "native": 1.25, "native-expandable": 1.005}
# As run_all.sh runs them: gpumem-plain in round 1 only.
STEP_ROUNDS = {"gpumem": 3, "gpumem-plain": 1, "native": 3, "native-expandable": 3}
# Part 8's cases as run_all.sh runs them, and gpumem's rate over native's in each (a few missed).
THREAD_CASES = [("own", t) for t in (1, 2, 4, 8, 16)] + [("shared", t) for t in (4, 8, 16)]
THREAD_RATIO = {("own", 8): 1.5, ("shared", 16): 0.8}  # else 2.5
# Part 9: ops/s per process, and a different number of processes per allocator, so that a row
# taking in the other allocator's files comes out different.
WORKLOAD_OPS = {"gpumem": [120e3, 130e3, 125e3], "native": [100e3, 110e3, 105e3, 108e3]}


def native_rate(streams: str, threads: int, r: int) -> float:
    """Apart for every case and process; round 2's is the median of three."""
    return 1e6 + 1e4 * threads + 5e3 * (streams == "shared") + 1e3 * r


def write(out: pathlib.Path, name: str, record: dict) -> None:
    (out / name).write_text(json.dumps(record))


def plant(out: pathlib.Path) -> None:
    for r, (native, gpumem) in enumerate([(700, 300), (750, 330), (900, 420)], start=1):
        subjects = {"native": native, "gpumem": gpumem, "cub": 1000 + r, "cudaMalloc": 30000 + r}
        write(out, f"allocators-{r}.json", {"subjects": {k: {"ns_per_pair": v} for k, v in subjects.items()}})
    for r, (gpumem, native) in enumerate([(1700, 2200), (1900, 2500), (1800, 2300)], start=1):
        write(out, f"torch_empty-gpumem-{r}.json", {"ns_per_pair": gpumem})
        write(out, f"torch_empty-native-{r}.json", {"ns_per_pair": native})
    for r, zero in enumerate([1600, 1650], start=1):  # two processes, apart from native's three
        write(out, f"torch_empty-native-zero-{r}.json", {"ns_per_pair": zero, "zero": True})
    for allocator, count in STEP_ROUNDS.items():
        for r in range(1, count + 1):
            ms = STEP_MS[allocator] + (r - 2) * 0.1 * (count > 1)  # the processes differ; the median is STEP_MS
            ratio = RATIO[allocator] + (r - 2) * 0.01 * (count > 1)
            # Two passes, as run_all.sh runs them, the first process's apart (their median is still
            # ms): the median over every pass of every process would be 0.05 ms above STEP_MS.
            passes = [ms - 0.3 * (r == 1), ms + 0.3 * (r == 1)]
            write(out, f"training-step-{allocator}-{r}.json", {
                "batch": 16, "lengths": LENGTHS, "step_ms": ms, "pass_s": [p * len(LENGTHS) / 1e3 for p in passes],
                "peak_allocated": 16 * GiB, "reserved_over_allocated": ratio,
            })
    for r in (1, 2, 3):
        cases = []
        for streams, threads in THREAD_CASES:
            native = native_rate(streams, threads, r)
            gpumem = native * THREAD_RATIO.get((streams, threads), 2.5)
            cases.append({"streams": streams, "threads": threads, "subjects": {
                "native": {"pairs_per_s": native}, "gpumem": {"pairs_per_s": gpumem}}})
        write(out, f"allocator-threads-{r}.json", {"mode": "threads", "pairs_per_thread": 4000, "cases": cases})
    for allocator, rates in WORKLOAD_OPS.items():
        for r, ops in enumerate(rates, start=1):
            write(out, f"threads-{allocator}-{r}.json", {
                "allocator": allocator, "threads": 8, "ops_per_s": ops, "cap": 6 * GiB, "limit": 6 * GiB,
                "peak_reserved": (5 + r / 4 + (allocator == "native")) * GiB, "cap_held": True})
    for r, ops in enumerate([111e3, 113e3], start=1):  # two processes, apart from native's four
        write(out, f"threads-native-noalloc-{r}.json", {
            "allocator": "native", "no_alloc": True, "threads": 8, "ops_per_s": ops, "cap": 6 * GiB,
            "limit": 6 * GiB, "peak_reserved": GiB, "cap_held": True})
    write(out, "training-reference.json", {"cap": 4 * GiB, "largest_batch": 2})
    for allocator, batch in {"gpumem": 2, "gpumem-plain": 3, "native": 1, "native-expandable": 4}.items():
        write(out, f"training-cap-{allocator}.json", {
            "largest_batch": batch, "length": 1024, "cap_held": True,
            "failure": {"batch": batch + 1, "verdict": f"{allocator} failed"},
        })
    replay = {"peak_allocated": 2 * GiB, "min_limit": int(2.02 * GiB), "min_limit_over_peak_allocated": 1.01,
              "original_reserved_over_peak_allocated": 1.2, "recorded_on": "NVIDIA H200, torch 2.11.0",
              "plain": {"min_limit": int(2.2 * GiB), "min_limit_over_peak_allocated": 1.1}}
    write(out, "replay.json", {"snapshots": {"gpt_adamw": replay, "tiny": {**replay, "recorded_on": "synthetic"}}})
    write(out, "machine.json", MACHINE)
    (out / "command.txt").write_text(COMMAND + "\n")


# As benchmarks/machine.py and run_all.sh write them.
MACHINE = {"gpu": "NVIDIA H200", "gpu_memory": int(139.8 * GiB), "driver": "580.159.04", "torch": "2.11.0+cu130",
           "cuda": "13.0", "cpus": 16, "gpumem_commit": "0f46276", "gpumem_module": "/x/_C.so",
           "date": "2026-12-06 00:20 UTC"}
COMMAND = "BENCH_TRAIN_ROUNDS=2 bash benchmarks/run_all.sh bench-out"


def printed(out: pathlib.Path) -> str:
    """summarize.py's output for OUTDIR `out`, named as run_all.sh's user names it (relative)."""
    done = subprocess.run([sys.executable, str(SUMMARIZE), out.name], cwd=out.parent, capture_output=True,
                          text=True, check=True)
    return done.stdout


def line(text: str, start: str) -> str:
    [found] = [x for x in text.splitlines() if x.startswith(start)]
    return found


def summary(out: pathlib.Path) -> dict:
    """The table's rows by figure: {figure: (value, target, verdict)}; every figure once."""
    rows = [line.strip("| ").split(" | ") for line in printed(out).splitlines() if line.startswith("| ")]
    rows = [r for r in rows if r[0] not in ("#", "---")]
    figures = [r[1] for r in rows]
    assert len(figures) == len(set(figures)), f"a figure appears twice: {figures}"
    return {r[1]: tuple(r[2:]) for r in rows}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    plant(out)
    return summary(out)


def row_for(table: dict, start: str) -> tuple:
    [found] = [value for figure, value in table.items() if figure.startswith(start)]
    return found


@pytest.mark.parametrize("allocator", list(STEP_MS))
def test_each_allocators_step_time_comes_from_its_own_processes(table, allocator):
    value, _, _ = row_for(table, f"step time, {allocator} (")
    assert value.startswith(f"{STEP_MS[allocator]:.2f} ms ({STEP_ROUNDS[allocator]} process")


@pytest.mark.parametrize("allocator", list(RATIO))
def test_each_allocators_reserved_over_allocated_comes_from_its_own_processes(table, allocator):
    value, _, _ = table[f"peak reserved / peak allocated, {allocator}"]
    assert value.startswith(f"{RATIO[allocator]:.4f} (peak allocated 16.00 GiB; {STEP_ROUNDS[allocator]} process")


def test_part_three_shows_the_spread_of_the_processes(table):
    assert table["peak reserved / peak allocated, native"][0] == \
        "1.2500 (peak allocated 16.00 GiB; 3 processes: min 1.2400, median 1.2500, max 1.2600)"
    assert row_for(table, "step time, gpumem-plain (")[0] == "29.00 ms (1 process: 29.00 ms)"


def test_the_targets_compare_gpumem_with_native_and_native_expandable_only(table):
    value, target, verdict = table["throughput, gpumem / native (native step time / gpumem's)"]
    assert value == f"{30.0 / 28.0:.4f}" and target == ">= 1.00" and verdict == "met (1.071 >= 1.0)"
    _, target, verdict = table["peak reserved / peak allocated, gpumem"]
    assert target == "< native-expandable (1.0050)" and verdict == "missed by 0.0950"


def test_torch_empty_shows_the_median_and_spread_of_its_processes(table):
    native = table["torch.empty + release, native"][0]
    gpumem = table["torch.empty + release, gpumem"][0]
    assert native == "2300 ns/pair (3 processes: min 2200 ns, median 2300 ns, max 2500 ns)"
    assert gpumem == "1800 ns/pair (0.783 x native; 3 processes: min 1700 ns, median 1800 ns, max 1900 ns)"
    _, target, verdict = table["torch.empty + release, gpumem"]
    assert target == "<= 0.6 x native" and verdict == "missed by 0.183 (0.783 > 0.6)"


def test_torch_empty_of_0_bytes_gives_the_floor_from_its_own_processes(table):
    value, target, verdict = row_for(table, "torch.empty + release of 0-byte tensors, native")
    assert value == "1625 ns/pair (0.707 x native; 2 processes: min 1600 ns, median 1625 ns, max 1650 ns)"
    assert target == "-" and verdict == "the floor: an allocator that cost nothing would give 0.707 x native"


def test_the_workload_with_no_allocator_work_gives_the_ceiling_from_its_own_processes(table):
    value, target, verdict = row_for(table, "multithreaded workload with no allocator work")
    assert value == "112000 ops/s (1.052 x native; 2 processes: min 111000 ops/s, median 112000 ops/s, max 113000 ops/s)"
    assert target == "-" and verdict == "the ceiling: an allocator that cost nothing would give 1.052 x native"


def test_allocator_cost_is_the_median_over_processes_with_their_spread(table):
    assert table["malloc+free pair, PyTorch native (CUDAAllocator)"][0] == \
        "750 ns (3 processes: min 700 ns, median 750 ns, max 900 ns)"
    value, target, verdict = table["malloc+free pair, gpumem (CUDAAllocator)"]
    assert value == "330 ns (0.440 x native; 3 processes: min 300 ns, median 330 ns, max 420 ns)"
    assert target == "<= 0.33 x native" and verdict == "missed by 0.110 (0.440 > 0.33)"


@pytest.mark.parametrize("allocator, batch", [("gpumem", 2), ("gpumem-plain", 3), ("native", 1),
                                              ("native-expandable", 4)])
def test_each_allocators_capped_run_is_its_own(table, allocator, batch):
    value, _, _ = row_for(table, f"largest batch at length 1024 under the cap, {allocator} (")
    assert value == f"{batch} (batch {batch + 1} failed: {allocator} failed)"


def test_a_missing_part_is_reported_as_not_measured(tmp_path):
    write(tmp_path, "training-step-gpumem-plain-1.json", {
        "batch": 16, "lengths": LENGTHS, "step_ms": 29.0, "pass_s": [0.464], "peak_allocated": GiB,
        "reserved_over_allocated": 1.5,
    })
    rows = summary(tmp_path)
    assert rows["step time, gpumem"][0] == "not measured (see training-step-gpumem-*.log)"
    assert rows["malloc+free pair through CUDAAllocator"][0] == "not measured (see allocators-*.log)"
    assert row_for(rows, "step time, gpumem-plain (")[0] == "29.00 ms (1 process: 29.00 ms)"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("run") / "bench-out"
    out.mkdir()
    plant(out)
    return out


def test_the_section_names_the_command_that_made_the_run_and_the_one_that_made_the_section(full_run):
    assert line(printed(full_run), "- **Command**") == \
        f"- **Command**: `{COMMAND}`, then `python3 benchmarks/summarize.py bench-out`"


def test_a_run_without_its_command_says_so(tmp_path):
    assert line(printed(tmp_path), "- **Command**") == \
        f"- **Command**: not recorded ({tmp_path.name} has no command.txt); this section: " \
        f"`python3 benchmarks/summarize.py {tmp_path.name}`"


def test_the_section_names_the_machine_and_the_date_without_a_commit(full_run):
    text = printed(full_run)
    assert line(text, "- **Machine**") == \
        "- **Machine**: NVIDIA H200 (139.8 GiB), driver 580.159.04, 16 CPUs; torch 2.11.0+cu130, CUDA 13.0"
    assert line(text, "- **Date**") == "- **Date**: 2026-12-06 00:20 UTC"
    assert MACHINE["gpumem_commit"] not in text  # the docs' prose carries no commit hash


def test_a_run_from_a_tree_with_uncommitted_changes_says_so(tmp_path):
    write(tmp_path, "machine.json", {**MACHINE, "gpumem_commit": "0f46276 + uncommitted changes"})
    assert line(printed(tmp_path), "- **Machine**").endswith("; gpumem built from a tree with uncommitted changes")


def test_a_run_without_machine_json_says_the_machine_is_not_recorded(tmp_path):
    text = printed(tmp_path)
    assert line(text, "- **Machine**") == "- **Machine**: not recorded (no machine.json; see machine.log)"
    assert line(text, "- **Date**") == "- **Date**: not recorded"


def test_a_complete_run_says_nothing_is_missing(full_run):
    assert line(printed(full_run), "- **Not in this run**") == \
        "- **Not in this run**: nothing: every row run_all.sh measures is here"
    assert not any(value.startswith("not measured") for value, _, _ in summary(full_run).values())


@pytest.mark.parametrize("removed, named", [
    ("torch_empty-native-zero-*.json",
     "part 2, torch.empty + release of 0-byte tensors, native: torch's share, no allocator work "
     "(see torch_empty-native-zero-*.log)"),
    ("threads-native-noalloc-*.json",
     "part 9, multithreaded workload with no allocator work (views of one buffer a thread), native "
     "(see threads-native-noalloc-*.log)"),
    ("training-step-native-expandable-*.json", "part 3, step time, native-expandable "
                                               "(see training-step-native-expandable-*.log)"),
    ("training-cap-native.json", "part 4, largest batch under the cap, native (see training-cap-native.log)"),
    ("replay.json", "part 5, replay of the shipped snapshots (see replay.log)"),
    ("allocators-*.json", "part 1, malloc+free pair through CUDAAllocator (see allocators-*.log)"),
    ("threads-gpumem-*.json", "part 9, multithreaded workload, gpumem (see threads-gpumem-*.log); part 9, "
                              "multithreaded workload, highest peak reserved over the processes: gpumem / native "
                              "(see threads-*.log)"),
])
def test_the_rows_missing_from_a_run_are_named_on_one_line(tmp_path, removed, named):
    plant(tmp_path)
    for path in tmp_path.glob(removed):
        path.unlink()
    text = printed(tmp_path)
    assert line(text, "- **Not in this run**") == f"- **Not in this run**: {named}"
    figure = named.split(", ", 1)[1].split(" (see ", 1)[0]
    assert summary(tmp_path)[figure][0].startswith("not measured (see ")


def test_a_thread_case_missing_from_every_process_is_named(tmp_path):
    plant(tmp_path)
    for path in tmp_path.glob("allocator-threads-*.json"):
        record = json.loads(path.read_text())
        record["cases"] = [c for c in record["cases"] if (c["streams"], c["threads"]) != ("shared", 16)]
        write(tmp_path, path.name, record)
    assert line(printed(tmp_path), "- **Not in this run**") == \
        "- **Not in this run**: part 8, aggregate malloc+free pairs, 16 threads, shared streams (see allocator-threads-*.log)"


def test_without_native_gpumems_rows_are_shown_but_not_judged(tmp_path):
    plant(tmp_path)
    for path in tmp_path.glob("torch_empty-native-[0-9]*.json"):
        path.unlink()
    rows = summary(tmp_path)
    assert rows["torch.empty + release, native"][0] == "not measured (see torch_empty-native-*.log)"
    assert rows["torch.empty + release, gpumem"] == (
        "1800 ns/pair (3 processes: min 1700 ns, median 1800 ns, max 1900 ns)", "<= 0.6 x native",
        "not judged: native not measured")


def test_an_unreadable_file_is_reported_in_its_part_and_the_others_still_print(tmp_path):
    plant(tmp_path)
    (tmp_path / "allocators-2.json").write_text('{"subjects": {"native": ')  # a process killed mid-write
    text = printed(tmp_path)
    rows = summary(tmp_path)
    assert rows["part 1"][0].startswith("unreadable results (JSONDecodeError: ")
    assert line(text, "- **Not in this run**") == "- **Not in this run**: part 1 (its files are unreadable)"
    assert rows["torch.empty + release, native"][2] == "baseline"


def test_the_section_ends_with_how_to_read_it(full_run):
    text = printed(full_run)
    assert text.startswith("## One run of run_all.sh\n")
    assert text.index("| # | figure | value | target | verdict |") < text.index("### How to read it")
    assert "- **value**: the median over the processes" in text


def thread_row(table: dict, allocator: str, streams: str, threads: int) -> tuple:
    case = f"{threads} thread{'s' * (threads > 1)}, {streams} streams"
    return table[f"aggregate malloc+free pairs, {case}, {allocator} (CUDAAllocator, 4000 pairs a thread)"]


@pytest.mark.parametrize("streams, threads", THREAD_CASES)
def test_each_thread_count_and_stream_mode_is_a_row_of_its_own_cases(table, streams, threads):
    native = native_rate(streams, threads, 2)
    ratio = THREAD_RATIO.get((streams, threads), 2.5)
    value, _, verdict = thread_row(table, "native", streams, threads)
    assert value.startswith(f"{native / 1e6:.3f} M/s (3 processes: min {native_rate(streams, threads, 1) / 1e6:.3f}")
    assert verdict == "baseline"
    value, _, _ = thread_row(table, "gpumem", streams, threads)
    assert value.startswith(f"{native * ratio / 1e6:.3f} M/s ({ratio:.3f} x native; 3 processes")


def test_the_thread_targets_are_twice_native_at_8_own_streams_and_native_elsewhere(table):
    _, target, verdict = thread_row(table, "gpumem", "own", 8)
    assert target == ">= 2 x native" and verdict == "missed by 0.500 (1.500 < 2.0)"
    _, target, verdict = thread_row(table, "gpumem", "shared", 16)
    assert target == ">= 1 x native" and verdict.startswith("missed")
    _, target, verdict = thread_row(table, "gpumem", "own", 16)
    assert target == ">= 1 x native" and verdict.startswith("met")


def test_part_eight_has_exactly_the_planted_cases(table):
    rows = [figure for figure in table if figure.startswith("aggregate malloc+free pairs")]
    assert len(rows) == 2 * len(THREAD_CASES)


def test_the_threaded_workload_rows_come_from_each_allocators_own_processes(table):
    native = table["multithreaded workload, native (8 threads on their own streams, cap 6 GiB)"][0]
    gpumem, target, verdict = table["multithreaded workload, gpumem (8 threads on their own streams, cap 6 GiB)"]
    assert native == "106500 ops/s (4 processes: min 100000 ops/s, median 106500 ops/s, max 110000 ops/s)"
    assert gpumem == \
        f"125000 ops/s ({125e3 / 106.5e3:.3f} x native; 3 processes: min 120000 ops/s, median 125000 ops/s, max 130000 ops/s)"
    assert target == ">= 1.1 x native" and verdict.startswith("met")


def test_the_threaded_workload_reports_the_peak_reserved_under_gpumems_limit(table):
    value, target, verdict = table["multithreaded workload, highest peak reserved over the processes: gpumem / native"]
    assert value == "5.750 / 7.000 GiB (gpumem's limit 6.000 GiB)"
    assert target == "gpumem <= its limit" and verdict == "met"


def test_a_gpumem_process_that_passed_its_limit_is_a_missed_target(tmp_path):
    for allocator, held in (("gpumem", True), ("gpumem", False), ("native", True)):
        r = len(list(tmp_path.glob(f"threads-{allocator}-*.json"))) + 1
        write(tmp_path, f"threads-{allocator}-{r}.json", {
            "allocator": allocator, "threads": 8, "ops_per_s": 1e5, "cap": 6 * GiB, "limit": 6 * GiB,
            "peak_reserved": (5 if held else 7) * GiB, "cap_held": held})
    verdict = summary(tmp_path)["multithreaded workload, highest peak reserved over the processes: gpumem / native"][2]
    assert verdict == "missed: passed it in 1 of 2 processes"


def test_run_all_records_its_command_with_the_settings_from_the_environment(tmp_path):
    """run_all.sh writes command.txt before anything else can fail: here the install, with an
    interpreter that fails at once."""
    out = tmp_path / "bench out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    env.update(PYTHON="false", BENCH_TRAIN_ROUNDS="2")
    done = subprocess.run(["bash", str(SUMMARIZE.parent / "run_all.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    quoted = str(out).replace(" ", "\\ ")
    assert (out / "command.txt").read_text() == f"PYTHON=false BENCH_TRAIN_ROUNDS=2 bash benchmarks/run_all.sh {quoted}\n"
    assert line(printed(out), "- **Command**") == \
        f"- **Command**: `PYTHON=false BENCH_TRAIN_ROUNDS=2 bash benchmarks/run_all.sh {quoted}`, then " \
        "`python3 benchmarks/summarize.py bench out`"


DOC = SUMMARIZE.parents[1] / "docs" / "benchmarks.md"
BEGIN = "<!-- The section below is summarize.py's output, unedited"
END = "<!-- End of summarize.py's output. -->"


def test_the_docs_first_section_after_the_measurements_is_summarizes_output(full_run):
    """docs/benchmarks.md carries one run's section as summarize.py prints it: the same opening,
    the same lines naming the command and the machine, a table of its columns, the same guide."""
    doc = DOC.read_text()
    block = doc[doc.index(BEGIN):doc.index(END)].split("-->\n", 1)[1].rstrip("\n")
    ours = printed(full_run).rstrip("\n")
    assert doc.index(BEGIN) < doc.index("## ")  # the first section of the page
    assert block.split("\n", 1)[0] == ours.split("\n", 1)[0] == "## One run of run_all.sh"
    for start in ("- **Command**: ", "- **Machine**: ", "- **Date**: ", "- **Not in this run**: "):
        assert line(block, start)
    assert "| # | figure | value | target | verdict |\n|---|---|---|---|---|\n| 1 | " in block
    guide = ours[ours.index("### How to read it"):]
    assert block.endswith("\n\n" + guide)
    assert "\n\n" + guide not in doc.replace(block, "")  # the guide is printed, not also written by hand


def test_the_docs_prose_names_no_gpumem_commit():
    """History lives in git: no docs page cites a commit of this repository (PyTorch's commits,
    which name the test files compatibility.md ran, are not this repository's)."""
    root = SUMMARIZE.parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    pages = [root / "README.md"] + [p for p in sorted((root / "docs").glob("*.md")) if p.name != "design.md"]
    cited = []
    for page in pages:
        for token in sorted(set(re.findall(r"\b[0-9a-f]{7,40}\b", page.read_text()))):
            known = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{token}^{{commit}}"],
                                   capture_output=True)
            if known.returncode == 0:
                cited.append(f"{page.name}: {token}")
    assert cited == []
