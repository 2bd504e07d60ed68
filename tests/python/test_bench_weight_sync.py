"""benchmarks/bench_weight_sync.py without a GPU: the weights it sends, each configuration's record
and table row from its own processes' results only, which side's error a failed configuration
reports, its options, and that without a GPU it says so and measures nothing."""
import subprocess
import sys

import pytest
import torch

from conftest import BENCHMARKS as BENCH, load_benchmark

bench = load_benchmark("bench_weight_sync")

GiB = 1 << 30


def side(result=None, exit_status=0, stderr_tail="no output") -> dict:
    return {"exit": exit_status, "result": result, "stderr_tail": stderr_tail}


def figures(allocated: float, reserved: float, nvml=None) -> dict:
    return {"allocated": int(allocated * GiB), "reserved": int(reserved * GiB), "nvml_used": nvml}


def measured(round_s: list[float]) -> dict:
    """Both sides of a configuration that ran, its rounds taking `round_s`."""
    rounds = [{"round_s": t, "request_to_received_s": t / 4, "rebuild_s": t / 4, "copy_s": t / 2,
               "release_s": 0.01} for t in round_s]
    memory = {"after_rounds": {"sender": figures(1.88, 2.0, nvml=int(2.5 * GiB)), "receiver": figures(1.88, 2.0)},
              "after_release": {"sender": figures(1.88, 2.0), "receiver": figures(1.88, 2.0)}}
    return {"sender": side({"ok": True, "share_s": [0.002] * len(round_s)}),
            "receiver": side({"ok": True, "rounds": rounds, "memory": memory, "values_match": True})}


def row(table: str, configuration: str) -> list[str]:
    [line] = [line for line in table.splitlines() if line.startswith(f"| {configuration} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_default_weights_are_a_billion_bf16_parameters_in_a_llama_like_models_tensors():
    shapes = dict(bench.weight_shapes(20))
    assert 0.98e9 < bench.parameter_count(20) < 1.03e9
    assert len(shapes) == 183
    assert shapes["embed_tokens"] == shapes["lm_head"] == (32000, 2048)
    assert shapes["layers.0.k_proj"] == (256, 2048) and shapes["layers.19.down_proj"] == (2048, 5632)


def test_each_configurations_row_comes_from_its_own_rounds_only():
    fast = bench.record("native", "native", "plain", 20, 20, measured([0.5, 0.1, 0.2, 0.3]), 30.0)
    slow = bench.record("gpumem", "native", "plain", 20, 20, measured([2.0, 0.9, 1.1]), 30.0)
    assert (fast["round_s_median"], fast["round_s_max"], fast["rounds"]) == (0.25, 0.5, 4)
    assert (slow["round_s_median"], slow["round_s_max"], slow["rounds"]) == (1.1, 2.0, 3)
    table = bench.table([fast, slow])
    assert row(table, "native->native plain")[2:5] == ["4 of 20", "250.0", "500.0"]
    assert row(table, "gpumem->native plain")[2:5] == ["3 of 20", "1100.0", "2000.0"]
    assert row(table, "native->native plain")[8] == "1.88 / 2.00 (2.50) -> 1.88 / 2.00"


def test_a_failed_configuration_reports_the_side_that_failed_by_itself_not_the_one_that_saw_it_end():
    sides = {"sender": side({"ok": False, "error": "PeerEnded: the other process failed", "peer_ended": True}, 1),
             "receiver": side({"ok": False, "error": "RuntimeError: pidfd_getfd: Operation not permitted",
                               "peer_ended": False}, 1)}
    rec = bench.record("gpumem", "native", "growable", 20, 20, sides, 5.0)
    assert rec["status"] == "failed"
    assert rec["error"] == "receiver: RuntimeError: pidfd_getfd: Operation not permitted"
    assert row(bench.table([rec]), "gpumem->native growable")[1] == f"failed: {rec['error']}"


def test_a_side_that_died_without_a_result_is_reported_by_its_exit_status_and_last_stderr_line():
    sides = {"sender": side(None, -6, "terminate called after throwing an instance of 'c10::Error'"),
             "receiver": side({"ok": False, "error": "PeerEnded: the other process ended", "peer_ended": True}, 1)}
    rec = bench.record("gpumem", "gpumem", "plain", 20, 20, sides, 5.0)
    assert rec["error"] == "sender: exit status -6: terminate called after throwing an instance of 'c10::Error'"


def test_the_error_line_is_the_last_line_of_the_exception_with_its_type():
    assert bench.last_line(RuntimeError("CUDA error: invalid argument\nFor debugging pass X=1")) == \
        "RuntimeError: For debugging pass X=1"
    assert bench.last_line(ValueError("one line")) == "ValueError: one line"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "bench_weight_sync.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=BENCH)


@pytest.mark.parametrize("option, value", [("--pairs", "native-cpu"), ("--segments", "flat")])
def test_an_unknown_pair_or_segment_kind_is_refused_naming_the_choices(option, value):
    done = run(option, value)
    assert done.returncode == 2
    assert f"not {value}" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmark runs for real")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    done = run("--out", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU here; nothing measured" in done.stdout
    assert not (tmp_path / "out.json").exists()


def test_the_chunk_names_a_configuration_only_where_a_gpumem_side_has_growable_memory():
    assert bench.configuration_name("gpumem", "native", "growable", "16MB") == "gpumem->native growable, GPUMEM_CHUNK=16MB"
    assert bench.configuration_name("native", "native", "growable", "16MB") == "native->native growable"
    assert bench.configuration_name("gpumem", "gpumem", "plain", "16MB") == "gpumem->gpumem plain"
    assert bench.configuration_name("gpumem", "gpumem", "growable") == "gpumem->gpumem growable"


def test_a_bad_chunk_is_refused_naming_it_and_the_forms():
    done = run("--chunk", "1GB")
    assert done.returncode == 2
    assert "--chunk" in done.stderr and "'1GB'" in done.stderr and "256 MB" in done.stderr
