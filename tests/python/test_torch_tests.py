"""tools/torch_tests.py, the runner of PyTorch's test files natively and under gpumem: its summary
over planted result files, and its runs (natively, on a planted test file with no torch in it) of
a test that kills its process and of one that hangs. CPU only."""
import json
import pathlib
import subprocess
import sys
import textwrap

RUNNER = pathlib.Path(__file__).resolve().parents[2] / "tools" / "torch_tests.py"


def runner(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), *args], capture_output=True, text=True, timeout=timeout)


def start(test: str) -> dict:
    return {"event": "start", "id": test}


def report(test: str, when: str, outcome: str, text: str = "", xfail: bool = False) -> dict:
    return {"event": "report", "id": test, "when": when, "outcome": outcome, "xfail": xfail, "text": text}


def ran(test: str, call: str, text: str = "") -> list[dict]:
    """The three reports pytest writes for a test whose call ends as `call`."""
    return [start(test), report(test, "setup", "passed"), report(test, "call", call, text),
            report(test, "teardown", "passed")]


def write_log(path: pathlib.Path, events: list[dict], cut_line: bool = False) -> None:
    text = "".join(json.dumps(e) + "\n" for e in events)
    path.write_text(text + ('{"event": "rep' if cut_line else ""))  # a line a crash cut short


F = "test_x.py::TestX::"


def plant(out: pathlib.Path) -> None:
    """Five tests: natively a, b and d pass, c fails, e skips. Under gpumem a and c pass, b fails,
    d kills its process (the runner's record), e has not run yet."""
    rdir = out / "test_x.py"
    rdir.mkdir(parents=True)
    (rdir / "file.txt").write_text("test_x.py\n")
    (rdir / "selected.txt").write_text("".join(F + t + "\n" for t in "abcde"))
    write_log(rdir / "native.jsonl", ran(F + "a", "passed") + ran(F + "b", "passed")
              + ran(F + "c", "failed", "E   AssertionError: native") + ran(F + "d", "passed")
              + ran(F + "e", "skipped", "Skipped: needs two GPUs"))
    write_log(rdir / "gpumem.jsonl", ran(F + "a", "passed")
              + ran(F + "b", "failed", "x = 1\nE   AssertionError: '65536' not found\nmore context")
              + ran(F + "c", "passed") + [start(F + "d")]
              + [{"event": "runner", "id": F + "d", "outcome": "crash", "text": "status -11"}],
              cut_line=True)


def test_summary_counts_each_mode_from_its_own_log(tmp_path):
    plant(tmp_path)
    done = runner("summary", str(tmp_path), "--json")
    [row] = json.loads(done.stdout)
    assert row["tests"] == 5
    assert row["passed_native"] == 3
    assert row["passed_gpumem"] == 2
    assert [x["test"] for x in row["failed_only_gpumem"]] == [F + "b", F + "d"]
    assert row["failed_only_gpumem"][0]["reason"] == "E   AssertionError: '65536' not found"
    assert [x["test"] for x in row["crashes"]["gpumem"]] == [F + "d"]
    assert row["crashes"]["native"] == []
    assert row["passed_only_gpumem"] == [F + "c"]
    assert row["not_run"] == {"native": [], "gpumem": [F + "e"]}
    assert done.returncode == 3  # e is still to run under gpumem


def test_summary_table_names_what_fails_only_under_gpumem(tmp_path):
    plant(tmp_path)
    table = runner("summary", str(tmp_path)).stdout
    assert "| test_x.py | 5 | 3 | 2 | `b`, `d` | 0 / 1 | 0 / 1 |" in table
    assert f"- {F}d (crash): status -11" in table


def test_summary_of_a_finished_run_exits_0(tmp_path):
    plant(tmp_path)
    log = tmp_path / "test_x.py" / "gpumem.jsonl"
    log.write_text(log.read_text().rsplit("\n", 1)[0] + "\n" + "".join(json.dumps(e) + "\n" for e in ran(F + "e", "skipped")))
    done = runner("summary", str(tmp_path), "--json")
    assert json.loads(done.stdout)[0]["not_run"] == {"native": [], "gpumem": []}
    assert done.returncode == 0


def test_a_rerun_test_counts_by_its_last_run(tmp_path):
    """A test killed at the budget is run again: its first, unfinished run does not count."""
    plant(tmp_path)
    log = tmp_path / "test_x.py" / "native.jsonl"
    events = [start(F + "a"), report(F + "a", "setup", "passed")] + ran(F + "a", "failed", "E   boom")
    write_log(log, events)
    [row] = json.loads(runner("summary", str(tmp_path), "--json").stdout)
    assert row["passed_native"] == 0


PLANTED = """
import os
import time


def test_first():
    pass


def test_kills_its_process():
    os.abort()


def test_after_the_crash():
    assert 1 + 1 == 3, "wrong sum"


def test_hangs():
    time.sleep(120)


def test_last():
    pass
"""


def test_run_records_a_crash_and_a_hang_and_goes_on(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_planted.py").write_text(textwrap.dedent(PLANTED))
    out = tmp_path / "out"
    done = runner("run", str(tests), str(out), "--modes", "native", "--test-timeout", "30", "--budget", "200")
    assert done.returncode == 0, done.stdout + done.stderr
    [row] = json.loads(runner("summary", str(out), "--json").stdout)
    assert row["tests"] == 5
    assert row["passed_native"] == 2
    native = {x["test"].split("::")[-1]: x["outcome"] for x in row["crashes"]["native"]}
    assert native == {"test_kills_its_process": "crash", "test_hangs": "timeout"}
    log = (out / "test_planted.py" / "native.jsonl").read_text()
    assert '"test_planted.py::test_after_the_crash", "when": "call", "outcome": "failed"' in log
    assert row["not_run"]["native"] == []


def test_run_keeps_to_its_shard(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_four.py").write_text("".join(f"def test_{i}():\n    pass\n\n" for i in range(4)))
    out = tmp_path / "out"
    assert runner("run", str(tests), str(out), "--modes", "native", "--shard", "2/2").returncode == 0
    selected = (out / "test_four.py" / "selected.txt").read_text().split()
    assert selected == ["test_four.py::test_2", "test_four.py::test_3"]


def test_summary_says_why_a_file_did_not_collect(tmp_path):
    rdir = tmp_path / "test_y.py"
    rdir.mkdir()
    (rdir / "file.txt").write_text("test_y.py\n")
    (rdir / "selected.txt").write_text("")
    (rdir / "collect.out").write_text("ImportError while importing\nE   ModuleNotFoundError: No module named 'expecttest'\n")
    done = runner("summary", str(tmp_path))
    assert "| test_y.py | 0 | 0 | 0 | 0 | 0 / 0 | 0 / 0 |" in done.stdout
    assert "test_y.py: did not collect: E   ModuleNotFoundError: No module named 'expecttest'" in done.stdout


def test_run_with_jobs_deals_the_tests_among_workers_and_runs_each_once(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_six.py").write_text("import os\n\n" + "".join(f"def test_{i}():\n    pass\n\n" for i in range(5))
                                       + "def test_5():\n    os.abort()\n")
    out = tmp_path / "out"
    done = runner("run", str(tests), str(out), "--modes", "native", "--jobs", "2", "--budget", "200")
    assert done.returncode == 0, done.stdout + done.stderr
    rdir = out / "test_six.py"
    started = {}
    for k in (0, 1):
        for line in (rdir / f"native-w{k}.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                started.setdefault(event["id"], []).append(k)
    assert sorted(started) == [f"test_six.py::test_{i}" for i in range(6)]
    assert all(len(workers) == 1 for workers in started.values())
    assert set(started["test_six.py::test_0"] + started["test_six.py::test_1"]) == {0, 1}
    [row] = json.loads(runner("summary", str(out), "--json").stdout)
    assert row["passed_native"] == 5
    assert [x["test"] for x in row["crashes"]["native"]] == ["test_six.py::test_5"]
    # Run again: nothing is left, so nothing runs (in either the workers' logs or a new one).
    sizes = {p.name: p.stat().st_size for p in rdir.glob("native*.jsonl")}
    assert runner("run", str(tests), str(out), "--modes", "native").returncode == 0
    assert {p.name: p.stat().st_size for p in rdir.glob("native*.jsonl")} == sizes


def test_run_refuses_a_bad_jobs_count(tmp_path):
    done = runner("run", str(tmp_path), str(tmp_path / "out"), "--jobs", "0")
    assert done.returncode == 2
    assert "--jobs takes a whole number from 1 to 64, not '0'" in done.stderr


def test_a_process_killed_at_the_budget_after_its_last_test_leaves_the_run_complete(tmp_path):
    """Every test finished; the process lingering at exit is killed at the deadline: nothing is
    left to run, so the run is complete (exit 0), not to be run again."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_linger.py").write_text(  # lingers when run, not when collected
        "import atexit\nimport os\nimport time\n\nif 'TORCH_TESTS_COLLECT' not in os.environ:\n"
        "    atexit.register(time.sleep, 600)\n\n\ndef test_quick():\n    pass\n")
    out = tmp_path / "out"
    # The budget covers collecting and running: 25 s were too few on a GPU machine busy with 8
    # pytest workers ("0/1 run"); the test lasts the budget, as the process lingers to its end.
    done = runner("run", str(tests), str(out), "--modes", "native", "--budget", "60")
    assert "test_linger.py native: 1/1 run, 1 passed" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr


def test_segments_picks_the_kind_of_both_modes(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_tests_runner", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    assert "GPUMEM_SEGMENTS" not in runner.mode_env("gpumem", "90%")  # no --segments: each mode's own
    native, gpumem = runner.mode_env("native", "90%", "plain"), runner.mode_env("gpumem", "90%", "plain")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in native and gpumem["GPUMEM_SEGMENTS"] == "plain"
    native = runner.mode_env("native", "90%", "growable")
    assert native["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and "GPUMEM_SEGMENTS" not in native
