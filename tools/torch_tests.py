#!/usr/bin/env python3
"""Runs a directory of PyTorch's own test files natively and under gpumem, test by test, and
summarizes what differs. It holds no PyTorch test code: the tests come from the directory given.

    torch_tests.py run TESTS OUT [--file F ...] [-k EXPR] [--shard I/N] [--modes native,gpumem]
                       [--limit 90%] [--budget 480] [--test-timeout 300] [--jobs 1]
    torch_tests.py collect TESTS OUT [--file F ...] [-k EXPR]
    torch_tests.py summary OUT [--json]

run: for each test file (every test_*.py under TESTS, or those named with --file, relative to
TESTS), collects its tests (natively; -k filters them, --shard I/N keeps the I-th of N equal runs
of them, from 1), then runs them with pytest natively (no GPUMEM_* variable) and under gpumem
(GPUMEM_LIMIT=--limit: gpumem installs itself at torch's import). Each test's outcome is written
under OUT/<file>/<mode>.jsonl as it happens (tools/torch_tests_log.py). A test that kills its
process (a signal, an abort, an exit) is recorded as a crash, one that makes no progress for
--test-timeout seconds as a timeout (its process is killed), and the rest go on in a new process.
After --budget seconds it stops, killing the test under way (to run again); the same command run
again goes on where it stopped. --jobs N runs N pytest processes at once, the modes side by side
and each mode's tests dealt round-robin among N / (number of modes) of them (each writes
OUT/<file>/<mode>-w<k>.jsonl; every log of a mode counts): for slow files whose tests do not
depend on the device's free memory, since the processes share one GPU. Exit status: 0 every
selected test has an outcome in every mode; 3 some are still to run (run the command again); 2 bad
arguments, or gpumem did not install.

collect: collects each file natively and prints how many tests it has, or the end of its import
error (exit status 1 if a file collected none).

summary: per file, the tests selected, passed natively, passed under gpumem, those that passed
natively but failed under gpumem (named, with the error's last line), crashes and timeouts, and
tests not yet run. Exit status 0 if every selected test ran in both modes, 3 if not.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

TOOLS = pathlib.Path(__file__).resolve().parent
MODES = ("native", "gpumem")
FAILED = ("failed", "error", "crash", "timeout")
POLL_S = 0.5
MIN_START_S = 20  # no new pytest process with less than this left: collection alone takes seconds


# ---- outcomes from a log ------------------------------------------------------------------------

def read_events(path: pathlib.Path) -> list[dict]:
    """The log's events; a line cut short by a crash, or not an object, is skipped."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("id"), str):
            events.append(event)
    return events


def outcome_of(reports: list[dict]) -> tuple[str, str]:
    """A test's outcome from its setup/call/teardown reports, as pytest counts it."""
    for r in reports:
        if r.get("outcome") == "failed":
            return ("failed" if r.get("when") == "call" else "error"), str(r.get("text", ""))
    for r in reports:
        if r.get("outcome") == "skipped":
            return ("xfailed" if r.get("xfail") else "skipped"), str(r.get("text", ""))
    if any(r.get("when") == "call" and r.get("xfail") for r in reports):
        return "xpassed", ""
    return "passed", ""


def outcomes(path: pathlib.Path) -> dict[str, tuple[str, str]]:
    """id -> (outcome, text) for each test that finished (or that the runner recorded)."""
    reports: dict[str, list[dict]] = {}
    final: dict[str, tuple[str, str]] = {}
    for e in read_events(path):
        test = e["id"]
        kind = e.get("event")
        if kind == "start":
            reports[test] = []
            final.pop(test, None)
        elif kind == "report":
            reports.setdefault(test, []).append(e)
            if e.get("when") == "teardown":
                final[test] = outcome_of(reports[test])
        elif kind == "runner":
            final[test] = (str(e.get("outcome", "error")), str(e.get("text", "")))
    return final


def mode_logs(rdir: pathlib.Path, mode: str) -> list[pathlib.Path]:
    """The logs of a mode: the one of a run without --jobs, then each worker's."""
    return [rdir / f"{mode}.jsonl", *sorted(rdir.glob(f"{mode}-w*.jsonl"))]


def mode_outcomes(rdir: pathlib.Path, mode: str) -> dict[str, tuple[str, str]]:
    """id -> (outcome, text) over every log of the mode."""
    merged: dict[str, tuple[str, str]] = {}
    for log in mode_logs(rdir, mode):
        merged.update(outcomes(log))
    return merged


def last_started(events: list[dict]) -> str | None:
    """The test that started last and has no teardown report: the one under way when it stopped."""
    open_test = None
    for e in events:
        if e.get("event") == "start":
            open_test = e["id"]
        elif e.get("event") == "report" and e.get("when") == "teardown" and e["id"] == open_test:
            open_test = None
        elif e.get("event") == "runner" and e["id"] == open_test:
            open_test = None
    return open_test


# ---- running --------------------------------------------------------------------------------------

def mode_env(mode: str, limit: str, segments: str = "") -> dict[str, str]:
    """The environment of `mode`'s runs; `segments` ("growable" or "plain"), where given, picks the
    segment kind of both: expandable_segments natively, GPUMEM_SEGMENTS under gpumem."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}
    if segments:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if mode == "native" and segments == "growable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if mode == "gpumem":
            env["GPUMEM_SEGMENTS"] = segments
    if mode == "gpumem":
        env["GPUMEM_LIMIT"] = limit
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TOOLS), env.get("PYTHONPATH")]))
    return env


def pytest_cmd(tests: pathlib.Path, path: pathlib.Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "torch_tests_log", "-p", "no:cacheprovider", "-q",
            "--tb=short", "--rootdir", str(tests), *extra, str(path)]


def collect(tests: pathlib.Path, rel: str, keyword: str | None, out: pathlib.Path, limit: str) -> list[str]:
    tag = hashlib.sha1((keyword or "").encode()).hexdigest()[:8]
    cached = out / f"collected-{tag}.txt"
    if not cached.exists():
        path = tests / rel
        env = mode_env("native", limit) | {"TORCH_TESTS_COLLECT": str(cached)}
        extra = ["--collect-only"] + (["-k", keyword] if keyword else [])
        with open(out / "collect.out", "w") as log:
            subprocess.run(pytest_cmd(tests, path, extra), cwd=path.parent, env=env, stdout=log,
                           stderr=subprocess.STDOUT, timeout=600)
    if not cached.exists():
        return []
    return [line for line in cached.read_text().splitlines() if line]


def shard_of(ids: list[str], shard: tuple[int, int]) -> list[str]:
    i, n = shard
    return ids[(i - 1) * len(ids) // n: i * len(ids) // n]


def record(log: pathlib.Path, test: str, outcome: str, text: str) -> None:
    with open(log, "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "runner", "id": test, "outcome": outcome, "text": text}) + "\n")


def run_once(cmd, cwd, env, out_file, log, test_timeout, deadline) -> tuple[int | None, str | None]:
    """One pytest process; returns its exit status (None if killed) and why it was killed."""
    with open(out_file, "a") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    size, quiet_since = -1, time.monotonic()
    why = None
    while proc.poll() is None:
        time.sleep(POLL_S)
        now = time.monotonic()
        new_size = log.stat().st_size if log.exists() else 0
        if new_size != size:
            size, quiet_since = new_size, now
        if now >= deadline:
            why = "budget"
        elif now - quiet_since > test_timeout:
            why = "timeout"
        if why:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, why
    return proc.returncode, None


def run_mode(tests, rel, selected, mode, out, args, deadline, worker: str = "") -> bool:
    """Runs the selected tests not yet finished in `mode` (in any of its logs), in one process at a
    time, logging to `mode``worker`.jsonl; True when none is left."""
    name = f"{mode}{worker}"
    log = out / f"{name}.jsonl"
    env = mode_env(mode, args.limit, args.segments) | {"TORCH_TESTS_LOG": str(log), "TORCH_TESTS_ONLY": str(out / f"{name}.todo")}
    path = tests / rel
    while True:
        done = mode_outcomes(out, mode)
        todo = [t for t in selected if t not in done]
        if not todo:
            return True
        if deadline - time.monotonic() < MIN_START_S:
            return False
        (out / f"{name}.todo").write_text("".join(t + "\n" for t in todo))
        before = len(read_events(log))
        rc, why = run_once(pytest_cmd(tests, path, []), path.parent, env, out / f"{name}.out", log,
                           args.test_timeout, deadline)
        events = read_events(log)[before:]
        under_way = last_started(events)
        if why == "budget":  # killed at the deadline: done if its last test had finished by then
            done = mode_outcomes(out, mode)
            return all(t in done for t in selected)
        if under_way:
            outcome = "timeout" if why == "timeout" else "crash"
            record(log, under_way, outcome, f"the process {'was killed' if why else f'ended with status {rc}'}"
                   f" during this test; see {name}.out")
            continue
        if not any(e.get("event") == "start" for e in events):
            # Nothing ran: the file did not import, or crashed before its first test, in this mode.
            for t in todo:
                record(log, t, "error", f"not run: its process (status {rc}) ran no test: the file did not import, "
                   f"or the test was not collected in this mode; see {name}.out")
            return True
        # Tests ran and the process ended between two of them: go on with what is left.


def run_modes(tests, rel, selected, rdir, args, deadline) -> dict[str, bool]:
    """Each mode's run of the selected tests: one mode after the other, or with --jobs N, N / (number
    of modes) workers per mode (at least one) at once, each given every W-th test still to run."""
    if args.jobs == 1:
        return {mode: run_mode(tests, rel, selected, mode, rdir, args, deadline) for mode in args.modes}
    per_mode = max(1, args.jobs // len(args.modes))
    tasks = []
    for mode in args.modes:
        done = mode_outcomes(rdir, mode)
        todo = [t for t in selected if t not in done]
        tasks += [(mode, k, todo[k::per_mode]) for k in range(per_mode)]
    with concurrent.futures.ThreadPoolExecutor(len(tasks)) as pool:
        futures = [(mode, pool.submit(run_mode, tests, rel, part, mode, rdir, args, deadline, f"-w{k}"))
                   for mode, k, part in tasks]
        finished = {mode: True for mode in args.modes}
        for mode, future in futures:
            finished[mode] = future.result() and finished[mode]
    return finished


def check_gpumem(limit: str) -> str | None:
    """None if GPUMEM_LIMIT makes gpumem the allocator; else why not."""
    code = ("import json, torch, gpumem\nfrom gpumem import _autoload\n"
            "if torch.cuda.is_available(): torch.zeros(1, device='cuda')\n"
            "print(json.dumps({'state': _autoload.state, 'enabled': gpumem.is_enabled()}))")
    done = subprocess.run([sys.executable, "-c", code], env=mode_env("gpumem", limit), capture_output=True, text=True)
    try:
        seen = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"the check did not run (status {done.returncode}): {done.stderr.strip()[-500:]}"
    if seen.get("state") != "installed" or seen.get("enabled") is not True:
        return f"GPUMEM_LIMIT={limit} did not install gpumem: {seen}"
    return None


def machine(out: pathlib.Path) -> None:
    code = ("import json, torch\nd = {'torch': torch.__version__, 'git': torch.version.git_version, "
            "'cuda': torch.version.cuda}\nif torch.cuda.is_available(): d['gpu'] = torch.cuda.get_device_name(0)\n"
            "print(json.dumps(d))")
    done = subprocess.run([sys.executable, "-c", code], env=mode_env("native", ""), capture_output=True, text=True)
    (out / "machine.json").write_text(done.stdout.strip() or json.dumps({"error": done.stderr[-500:]}))


def result_dir(out: pathlib.Path, rel: str) -> pathlib.Path:
    return out / rel.replace("/", "__")


def test_files(args) -> tuple[pathlib.Path, pathlib.Path, list[str]] | None:
    tests = pathlib.Path(args.tests).resolve()
    out = pathlib.Path(args.out).resolve()
    if not tests.is_dir():
        print(f"torch_tests: no directory {tests}", file=sys.stderr)
        return None
    files = args.file or sorted(str(p.relative_to(tests)) for p in tests.rglob("test_*.py"))
    missing = [f for f in files if not (tests / f).is_file()]
    if missing:
        print(f"torch_tests: not in {tests}: {' '.join(missing)}", file=sys.stderr)
        return None
    out.mkdir(parents=True, exist_ok=True)
    return tests, out, files


def collect_all(args) -> int:
    """Collects each file natively and says how many tests it has, or why it did not import."""
    found = test_files(args)
    if not found:
        return 2
    tests, out, files = found
    status = 0
    for rel in files:
        rdir = result_dir(out, rel)
        rdir.mkdir(exist_ok=True)
        ids = collect(tests, rel, args.k, rdir, args.limit)
        print(f"{rel}: {len(ids)} tests")
        if not ids:
            status = 1
            tail = (rdir / "collect.out").read_text(errors="replace").splitlines()[-15:]
            print("\n".join("    " + line for line in tail))
    return status


def run(args) -> int:
    deadline = time.monotonic() + args.budget
    found = test_files(args)
    if not found:
        return 2
    tests, out, files = found
    if not (out / "machine.json").exists():
        machine(out)
    if "gpumem" in args.modes:
        why = check_gpumem(args.limit)
        if why:
            print(f"torch_tests: {why}", file=sys.stderr)
            return 2
    complete = True
    for rel in files:
        rdir = result_dir(out, rel)
        rdir.mkdir(exist_ok=True)
        (rdir / "file.txt").write_text(rel + "\n")
        ids = collect(tests, rel, args.k, rdir, args.limit)
        if not ids:
            print(f"{rel}: collected no tests (see {rdir / 'collect.out'})")
        selected = shard_of(ids, args.shard)
        known = set((rdir / "selected.txt").read_text().splitlines()) if (rdir / "selected.txt").exists() else set()
        with open(rdir / "selected.txt", "a") as f:
            f.writelines(t + "\n" for t in selected if t not in known)
        finished_of = run_modes(tests, rel, selected, rdir, args, deadline)
        for mode in args.modes:
            finished = finished_of[mode]
            got = mode_outcomes(rdir, mode)
            ran = [got[t][0] for t in selected if t in got]
            print(f"{rel} {mode}: {len(ran)}/{len(selected)} run, {ran.count('passed')} passed, "
                  f"{sum(o in FAILED for o in ran)} failed, crashed or timed out")
            complete = complete and finished
    if not complete:
        print("incomplete: run the same command again to go on")
        return 3
    return 0


# ---- summary ----------------------------------------------------------------------------------------

def reason(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    line = (errors or lines or [""])[-1]
    return line[:200]


def summarize_file(rdir: pathlib.Path) -> dict:
    selected = list(dict.fromkeys((rdir / "selected.txt").read_text().splitlines())) if (rdir / "selected.txt").exists() else []
    selected = [t for t in selected if t]
    got = {mode: mode_outcomes(rdir, mode) for mode in MODES}
    native, capped = got["native"], got["gpumem"]

    def named(tests: list[str], mode: str) -> list[dict]:
        return [{"test": t, "outcome": got[mode][t][0], "reason": reason(got[mode][t][1])} for t in tests]

    passed_native = [t for t in selected if native.get(t, ("",))[0] == "passed"]
    collected = any(rdir.glob("collected-*.txt"))
    return {
        "file": (rdir / "file.txt").read_text().strip() if (rdir / "file.txt").exists() else rdir.name,
        "collect_error": None if collected or not (rdir / "collect.out").exists()
        else reason((rdir / "collect.out").read_text(errors="replace")),
        "tests": len(selected),
        "passed_native": len(passed_native),
        "passed_gpumem": sum(capped.get(t, ("",))[0] == "passed" for t in selected),
        "failed_only_gpumem": named([t for t in passed_native if capped.get(t, ("",))[0] in FAILED], "gpumem"),
        "skipped_only_gpumem": named([t for t in passed_native if capped.get(t, ("",))[0] == "skipped"], "gpumem"),
        "passed_only_gpumem": [t for t in selected if capped.get(t, ("",))[0] == "passed"
                               and native.get(t, ("",))[0] in FAILED],
        "crashes": {mode: named([t for t in selected if got[mode].get(t, ("",))[0] in ("crash", "timeout")], mode)
                    for mode in MODES},
        "not_run": {mode: [t for t in selected if t not in got[mode]] for mode in MODES},
    }


def summary(args) -> int:
    out = pathlib.Path(args.out)
    rows = [summarize_file(d) for d in sorted(out.iterdir()) if (d / "selected.txt").exists()] if out.is_dir() else []
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows, out)
    return 0 if all(not any(r["not_run"].values()) for r in rows) and rows else 3


def print_table(rows: list[dict], out: pathlib.Path) -> None:
    if (out / "machine.json").exists():
        print(f"machine: {(out / 'machine.json').read_text().strip()}\n")
    print("| file | tests | passed natively | passed under gpumem | failed only under gpumem "
          "| crashes (native / gpumem) | not run (native / gpumem) |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: |")
    for r in rows:
        failed = ", ".join(f"`{x['test'].split('::')[-1]}`" for x in r["failed_only_gpumem"]) or "0"
        crashes = f"{len(r['crashes']['native'])} / {len(r['crashes']['gpumem'])}"
        not_run = f"{len(r['not_run']['native'])} / {len(r['not_run']['gpumem'])}"
        print(f"| {r['file']} | {r['tests']} | {r['passed_native']} | {r['passed_gpumem']} | {failed} "
              f"| {crashes} | {not_run} |")
    for r in rows:
        if r["collect_error"]:
            print(f"\n{r['file']}: did not collect: {r['collect_error']}")
        lists = [("failed only under gpumem", r["failed_only_gpumem"]),
                 ("passed natively, skipped under gpumem", r["skipped_only_gpumem"]),
                 ("crashed or timed out natively", r["crashes"]["native"]),
                 ("crashed or timed out under gpumem", r["crashes"]["gpumem"])]
        for title, items in lists:
            if items:
                print(f"\n{r['file']}: {title}:")
                for x in items:
                    print(f"- {x['test']} ({x['outcome']}): {x['reason']}")
        if r["passed_only_gpumem"]:
            print(f"\n{r['file']}: failed natively, passed under gpumem:")
            for t in r["passed_only_gpumem"]:
                print(f"- {t}")
        for mode in MODES:
            if r["not_run"][mode]:
                print(f"\n{r['file']}: {len(r['not_run'][mode])} tests not yet run {'natively' if mode == 'native' else 'under gpumem'}")


# ---- arguments ----------------------------------------------------------------------------------------

def shard_arg(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N, not {text!r}")
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--shard {text}: I must be from 1 to N")
    return i, n


def jobs_arg(text: str) -> int:
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if not 1 <= jobs <= 64:
        raise argparse.ArgumentTypeError(f"--jobs takes a whole number from 1 to 64, not {text!r}")
    return jobs


def modes_arg(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"--modes takes native, gpumem or both, not {text!r}")
    return modes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("tests")
    r.add_argument("out")
    r.add_argument("--file", action="append", help="a test file relative to TESTS (repeatable)")
    r.add_argument("-k", help="pytest's -k expression over the file's tests")
    r.add_argument("--shard", type=shard_arg, default=(1, 1))
    r.add_argument("--modes", type=modes_arg, default=list(MODES))
    r.add_argument("--segments", choices=("growable", "plain"), default="",
                   help="the segment kind of both modes (expandable_segments natively, GPUMEM_SEGMENTS under gpumem); "
                        "default: each one's own")
    r.add_argument("--limit", default="90%", help="GPUMEM_LIMIT for the gpumem runs (a share of the device by default: a size above the device is refused)")
    r.add_argument("--budget", type=float, default=480, help="seconds before it stops (to be run again)")
    r.add_argument("--test-timeout", type=float, default=300, help="seconds without progress before a test is killed")
    r.add_argument("--jobs", type=jobs_arg, default=1, help="pytest processes at once, the modes side by side")
    c = sub.add_parser("collect")
    c.add_argument("tests")
    c.add_argument("out")
    c.add_argument("--file", action="append")
    c.add_argument("-k")
    c.add_argument("--limit", default="90%")
    s = sub.add_parser("summary")
    s.add_argument("out")
    s.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    return {"run": run, "collect": collect_all, "summary": summary}[args.command](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
