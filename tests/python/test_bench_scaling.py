"""The benchmarks of replay time against trace length (bench_replay.py --scaling) and of the GPU
ramp (bench_ramp.py), run here at sizes that take seconds: what they print and record, and that
the ramp without a GPU says so and measures nothing."""
import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def bench(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=BENCH)


def test_the_scaling_row_replays_each_trace_whole_and_compares_it_with_the_shortest(tmp_path):
    out = tmp_path / "scaling.json"
    done = bench("bench_replay.py", "--scaling", "2000", "500", "--out", str(out))
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())["scaling"]
    assert sorted(runs) == ["churn", "ramp"]
    for shape_runs in runs.values():
        assert [r["events"] for r in shape_runs] == [500, 2000]  # shortest first
        assert shape_runs[0]["per_event_over_shortest"] == 1.0
        for r in shape_runs:
            assert r["total_s"] == pytest.approx(r["load_s"] + r["replay_s"])
            assert r["us_per_event"] == pytest.approx(r["total_s"] / r["events"] * 1e6)
    ramp = runs["ramp"][1]
    assert ramp["peak_allocated"] == ramp["peak_reserved"] == 2000 * 2 * (1 << 20)  # none freed, one page each
    table = done.stdout.split("\n\n")[0].splitlines()
    assert table[0].split()[:2] == ["trace", "events"]
    assert [line.split()[:2] for line in table[1:]] == [["ramp", "500"], ["ramp", "2,000"], ["churn", "500"],
                                                         ["churn", "2,000"]]


def test_the_scaling_row_refuses_a_length_below_one():
    done = bench("bench_replay.py", "--scaling", "0")
    assert done.returncode == 2
    assert "--scaling: each length is a number of events, at least 1" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the ramp runs for real")
def test_the_ramp_without_a_gpu_says_so_and_exits_0():
    done = bench("bench_ramp.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "bench_ramp: no CUDA GPU here; nothing measured\n"


@pytest.mark.parametrize("args, message", [
    (("--slice", "0"), "--slice: at least 1 allocation"),
    (("--child", "gpumem", "huge"), "--child: one of ('gpumem', 'native') and one of ['large', 'small']"),
    (("--ramps", "huge"), "invalid choice: 'huge'"),
])
def test_the_ramp_refuses_bad_arguments_in_one_line(args, message):
    done = bench("bench_ramp.py", *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
