"""benchmarks/summarize.py over planted result files: each allocator's rows come from its own
processes' files only, and repeated measurements show their spread. CPU only."""
import json
import pathlib
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


def write(out: pathlib.Path, name: str, record: dict) -> None:
    (out / name).write_text(json.dumps(record))


def plant(out: pathlib.Path) -> None:
    for r, (native, gpumem) in enumerate([(700, 300), (750, 330), (900, 420)], start=1):
        subjects = {"native": native, "gpumem": gpumem, "cub": 1000 + r, "cudaMalloc": 30000 + r}
        write(out, f"allocators-{r}.json", {"subjects": {k: {"ns_per_pair": v} for k, v in subjects.items()}})
    for r, (gpumem, native) in enumerate([(1700, 2200), (1900, 2500), (1800, 2300)], start=1):
        write(out, f"torch_empty-gpumem-{r}.json", {"ns_per_pair": gpumem})
        write(out, f"torch_empty-native-{r}.json", {"ns_per_pair": native})
    for allocator, count in STEP_ROUNDS.items():
        for r in range(1, count + 1):
            ms = STEP_MS[allocator] + (r - 2) * 0.1 * (count > 1)  # the processes differ; the median is STEP_MS
            ratio = RATIO[allocator] + (r - 2) * 0.01 * (count > 1)
            write(out, f"training-step-{allocator}-{r}.json", {
                "batch": 16, "lengths": LENGTHS, "step_ms": ms, "pass_s": [ms * len(LENGTHS) / 1e3] * 2,
                "peak_allocated": 16 * GiB, "reserved_over_allocated": ratio,
            })
    write(out, "training-reference.json", {"cap": 4 * GiB, "largest_batch": 2})
    for allocator, batch in {"gpumem": 2, "gpumem-plain": 3, "native": 1, "native-expandable": 4}.items():
        write(out, f"training-cap-{allocator}.json", {
            "largest_batch": batch, "length": 1024, "cap_held": True,
            "failure": {"batch": batch + 1, "verdict": f"{allocator} failed"},
        })


def summary(out: pathlib.Path) -> dict:
    """The table's rows by figure: {figure: (value, target, verdict)}; every figure once."""
    printed = subprocess.run([sys.executable, str(SUMMARIZE), str(out)], capture_output=True, text=True, check=True)
    rows = [line.strip("| ").split(" | ") for line in printed.stdout.splitlines() if line.startswith("| ")]
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
    assert table["throughput, gpumem / native (native step time / gpumem's)"][0] == f"{30.0 / 28.0:.4f}"
    _, target, verdict = table["peak reserved / peak allocated, gpumem"]
    assert target == "< native-expandable (1.0050)" and verdict == "missed by 0.0950"


def test_torch_empty_shows_the_median_and_spread_of_its_processes(table):
    native = table["torch.empty + release, native"][0]
    gpumem = table["torch.empty + release, gpumem"][0]
    assert native == "2300 ns/pair (3 processes: min 2200 ns, median 2300 ns, max 2500 ns)"
    assert gpumem == "1800 ns/pair (0.783 x native; 3 processes: min 1700 ns, median 1800 ns, max 1900 ns)"


def test_allocator_cost_is_the_median_over_processes_with_their_spread(table):
    assert table["malloc+free pair, PyTorch native (CUDAAllocator)"][0] == \
        "750 ns (3 processes: min 700 ns, median 750 ns, max 900 ns)"
    value, target, verdict = table["malloc+free pair, gpumem (CUDAAllocator)"]
    assert value == "330 ns (0.440 x native; 3 processes: min 300 ns, median 330 ns, max 420 ns)"
    assert target == "<= 0.5 x native" and verdict.startswith("met")


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
    assert rows["training step"][0] == "not measured (see training-step-*.log)"
