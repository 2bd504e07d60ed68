"""The `gpumem` command, run as `python -m gpumem` in a process of its own."""
from __future__ import annotations

import os
import pickle
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from conftest import environment_without_gpumem_settings
from fake_c import GiB, FakeC, use_fake_c
from gpumem import _C, _autoload, cli
from gpumem.trace import replay

DATA = pathlib.Path(__file__).parent / "data"
MiB = 1 << 20


def gpumem(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumem", *args], env={**environment_without_gpumem_settings(), **(env or {})},
                          capture_output=True, text=True, timeout=300)


def data(name: str) -> str:
    return str(DATA / f"{name}.pickle")


def assert_usage_error(completed: subprocess.CompletedProcess, *needles: str) -> None:
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert "Traceback" not in completed.stderr
    assert "error:" in completed.stderr
    for needle in needles:
        assert needle in completed.stderr


def value_of(stdout: str, label: str) -> str:
    return re.search(rf"^{re.escape(label)}\s+(.*)$", stdout, re.MULTILINE).group(1)


# ---- the command --------------------------------------------------------------------------------


def test_help_lists_every_verb_and_the_exit_statuses():
    completed = gpumem("--help")
    assert completed.returncode == 0
    assert all(verb in completed.stdout for verb in ("info", "run", "replay", "top"))
    assert "Exit status" in completed.stdout


@pytest.mark.parametrize("verb", ["info", "run", "replay", "top"])
def test_every_verb_has_help(verb):
    completed = gpumem(verb, "--help")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith(f"usage: gpumem {verb}")


def test_no_verb_is_a_usage_error():
    completed = gpumem()
    assert completed.returncode == 2 and "usage: gpumem" in completed.stderr


def test_an_unknown_verb_is_a_usage_error():
    assert_usage_error(gpumem("shrink"), "invalid choice: 'shrink'")


# ---- info ---------------------------------------------------------------------------------------


def test_info_lists_the_devices_or_says_there_is_none():
    completed = gpumem("info")
    assert completed.returncode == 0, completed.stderr
    if _C.device_count() == 0:
        assert "no CUDA device was found" in completed.stdout
    else:
        assert "device 0:" in completed.stdout and "gpumem memory report" in completed.stdout


def test_info_shows_gpumem_limit():
    completed = gpumem("info", env={"GPUMEM_LIMIT": "4GB"})
    assert completed.returncode == 0, completed.stderr
    assert "GPUMEM_LIMIT: '4GB'" in completed.stdout


# ---- run ----------------------------------------------------------------------------------------


def test_run_sets_gpumem_limit_and_passes_the_exit_status_through():
    program = "import os, sys; print(os.environ['GPUMEM_LIMIT']); sys.exit(3)"
    completed = gpumem("run", "--limit", "0:4GB,1:8GB", "--", sys.executable, "-c", program)
    assert completed.returncode == 3, completed.stderr
    assert completed.stdout.strip() == "0:4GB,1:8GB"


def test_run_rejects_a_bad_limit_before_launching(tmp_path):
    marker = tmp_path / "ran"
    completed = gpumem("run", "--limit", "4XB", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert_usage_error(completed, '"4XB"', "Accepted forms")
    assert not marker.exists()


def test_run_with_a_scope_sets_gpumem_scope_and_without_one_leaves_it_alone():
    program = "import os; print(os.environ.get('GPUMEM_SCOPE'))"
    completed = gpumem("run", "--limit", "4GB", "--scope", "Process", "--", sys.executable, "-c", program)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "process"
    completed = gpumem("run", "--limit", "4GB", "--", sys.executable, "-c", program, env={"GPUMEM_SCOPE": "process"})
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "process"
    completed = gpumem("run", "--limit", "4GB", "--", sys.executable, "-c", program)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "None"


def test_run_rejects_a_bad_scope_before_launching(tmp_path):
    marker = tmp_path / "ran"
    completed = gpumem("run", "--limit", "4GB", "--scope", "node", "--", sys.executable, "-c",
                       f"open({str(marker)!r}, 'w')")
    assert_usage_error(completed, "'node'", '"allocator" or "process"')
    assert not marker.exists()


def test_run_without_a_program_is_a_usage_error():
    assert_usage_error(gpumem("run", "--limit", "4GB"), "run needs a program")


def test_run_without_a_limit_is_a_usage_error():
    assert_usage_error(gpumem("run", "--", "true"), "--limit")


def test_run_of_a_missing_program_exits_127():
    completed = gpumem("run", "--limit", "4GB", "--", "no-such-program-gpumem")
    assert completed.returncode == 127
    assert "'no-such-program-gpumem' was not found" in completed.stderr


# ---- replay -------------------------------------------------------------------------------------


def test_replay_that_fits_says_so_and_exits_0():
    completed = gpumem("replay", data("big_blocks"), "--limit", "3GB")
    assert completed.returncode == 0, completed.stderr
    assert value_of(completed.stdout, "result") == "fits"
    expected = replay.replay(data("big_blocks"), "3GB")
    assert value_of(completed.stdout, "peak allocated") == _C.format_bytes(expected.peak_allocated)
    assert value_of(completed.stdout, "original reserved").startswith(_C.format_bytes(expected.original_peak_reserved))


def test_replay_that_fails_names_the_request_and_exits_1():
    completed = gpumem("replay", data("big_blocks"), "--limit", "500MB")
    expected = replay.replay(data("big_blocks"), "500MB").failure
    assert completed.returncode == 1, completed.stderr
    result = value_of(completed.stdout, "result")
    assert result.startswith(f"FAILED: event {expected.event_index} (time_us {expected.time_us})")
    assert f"({expected.size} bytes): {expected.kind}" in result
    assert "CUDA out of memory. Tried to allocate" in completed.stdout


def test_replay_min_limit_prints_the_limit_in_bytes():
    completed = gpumem("replay", data("train_like"), "--min-limit", "--precision", "256KiB")
    expected = replay.min_limit(data("train_like"), precision=256 * 1024)
    assert completed.returncode == 0, completed.stderr
    assert value_of(completed.stdout, "min limit").endswith(f"({expected.limit} bytes): fits; 256.00 KiB less fails")
    assert value_of(completed.stdout, "ratio") == f"{expected.ratio:.3f} x peak requested"
    # "peak allocated" is the allocator's figure, in every output; the trace's own peak has its own name.
    assert value_of(completed.stdout, "peak requested").startswith(_C.format_bytes(expected.peak_allocated))
    assert "peak allocated" not in completed.stdout


def test_replay_without_a_limit_replays_uncapped_and_prints_the_peaks_and_the_smallest_limit():
    completed = gpumem("replay", data("train_like"))
    assert completed.returncode == 0, completed.stderr
    uncapped = replay.replay(data("train_like"), None)
    smallest = replay.min_limit(data("train_like"))
    assert value_of(completed.stdout, "limit") == "none (uncapped)"
    assert value_of(completed.stdout, "result") == "fits"
    assert value_of(completed.stdout, "peak allocated") == _C.format_bytes(uncapped.peak_allocated)
    assert value_of(completed.stdout, "peak reserved").startswith(_C.format_bytes(uncapped.peak_reserved))
    assert value_of(completed.stdout, "original reserved").startswith(
        _C.format_bytes(uncapped.original_peak_reserved))
    assert value_of(completed.stdout, "smallest limit").startswith(
        f"{_C.format_bytes(smallest.limit)} ({smallest.limit} bytes")


def test_replay_uses_growable_segments_by_default_and_says_so():
    completed = gpumem("replay", data("train_like"), "--limit", "400MB")
    assert completed.returncode == 0, completed.stderr
    assert value_of(completed.stdout, "segments").startswith("growable (2.00 MiB pages")
    expected = replay.replay(data("train_like"), "400MB")
    assert value_of(completed.stdout, "peak reserved").startswith(_C.format_bytes(expected.peak_reserved))


@pytest.mark.parametrize("kind", ["plain", "growable"])
def test_replay_min_limit_with_segments_finds_that_kinds_limit(kind):
    completed = gpumem("replay", data("train_like"), "--min-limit", "--segments", kind)
    expected = replay.min_limit(data("train_like"), segments=kind)
    assert completed.returncode == 0, completed.stderr
    found = value_of(completed.stdout, "min limit")
    assert found.startswith(f"{_C.format_bytes(expected.limit)} ({expected.limit} bytes)")
    assert value_of(completed.stdout, "segments").startswith(kind)


def test_replay_with_plain_segments_reports_the_plain_replay():
    limit = replay.min_limit(data("train_like"), segments="growable").limit
    plain = replay.replay(data("train_like"), limit, segments="plain")
    completed = gpumem("replay", data("train_like"), "--limit", str(limit), "--segments", "plain")
    assert completed.returncode == (0 if plain.fits else 1), completed.stderr
    assert value_of(completed.stdout, "segments") == "plain (one cudaMalloc per segment)"


def test_replay_of_another_device_uses_its_trace():
    completed = gpumem("replay", data("two_devices"), "--limit", "1GB", "--device", "1")
    assert completed.returncode == 0, completed.stderr
    assert ", device 1:" in value_of(completed.stdout, "snapshot")


def test_replay_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    completed = gpumem("replay", data("train_like"), "--limit", "400MB", "--plot", str(path))
    assert completed.returncode == 0, completed.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name, needle", [
    ("missing", "no such file"),
    ("with_global", "refused: the pickle names the global collections.OrderedDict"),
    ("empty_trace", "the trace is empty"),
])
def test_replay_of_an_unusable_snapshot_is_an_error_without_a_traceback(name, needle):
    completed = gpumem("replay", data(name), "--limit", "1GB")
    assert_usage_error(completed, f"gpumem: error: {data(name)}: {needle}")


def test_replay_of_a_device_without_events_is_an_error():
    assert_usage_error(gpumem("replay", data("two_devices"), "--limit", "1GB", "--device", "0"),
                       "device 0 has no alloc or free events")


@pytest.mark.parametrize("args, needle", [
    (["--limit", "4XB"], 'bad limit "4XB"'),
    (["--limit", "1GB", "--min-limit"], "not allowed with argument"),
    (["--limit", "1GB", "--device", "first"], "'first' is not a device index"),
    (["--min-limit", "--precision", "5%"], "'5%' is not a positive size in bytes"),
    (["--limit", "1GB", "--colour"], "unrecognized arguments: --colour"),
    (["--limit", "1GB", "--segments", "expandable"], "invalid choice: 'expandable'"),
], ids=["bad-limit", "both-modes", "bad-device", "percent-precision", "unknown-flag", "bad-segments"])
def test_replay_bad_arguments_are_usage_errors(args, needle):
    assert_usage_error(gpumem("replay", data("big_blocks"), *args), needle)


def test_replay_with_a_limit_above_the_device_total_is_an_error():
    assert_usage_error(gpumem("replay", data("train_like"), "--limit", "20GB"), "more than")


def test_info_shows_gpumem_segments():
    completed = gpumem("info", env={"GPUMEM_SEGMENTS": "plain"})
    assert completed.returncode == 0, completed.stderr
    assert "GPUMEM_SEGMENTS: 'plain'" in completed.stdout


def test_info_with_an_invalid_gpumem_segments_says_so_and_exits_2():
    completed = gpumem("info", env={"GPUMEM_SEGMENTS": "fast"})
    assert completed.returncode == 2
    assert "GPUMEM_SEGMENTS: 'fast'\nGPUMEM_SEGMENTS is invalid: give \"growable\" or \"plain\"" in completed.stdout
    assert "Traceback" not in completed.stderr


def test_info_with_an_invalid_gpumem_limit_says_so_and_exits_2():
    completed = gpumem("info", env={"GPUMEM_LIMIT": "4XB"})
    assert completed.returncode == 2
    assert "GPUMEM_LIMIT: '4XB'\nGPUMEM_LIMIT is invalid: unknown unit \"XB\". Accepted forms" in completed.stdout
    assert "Traceback" not in completed.stderr


def test_info_with_an_invalid_gpumem_mem_info_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("GPUMEM_MEM_INFO", "free")
    assert cli.main(["info"]) == 2
    out = capsys.readouterr().out
    assert "GPUMEM_MEM_INFO: 'free'\nGPUMEM_MEM_INFO is invalid: give \"capped\" or \"device\"" in out


def test_info_on_devices_shows_each_with_the_limit_gpumem_limit_sets(fake_c, monkeypatch, capsys):
    # In this process, over two fake 8 GiB devices: the path a machine with GPUs takes.
    monkeypatch.setattr(fake_c, "largest_free_block", lambda d: 0, raising=False)
    monkeypatch.setenv("GPUMEM_LIMIT", "0:4GB,1:50%")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "device 0: " in out and "8.00 GiB total" in out and "GPUMEM_LIMIT sets 4.00 GiB" in out
    assert "device 1: " in out and "GPUMEM_LIMIT sets 4.00 GiB" in out.split("device 1: ")[1]
    assert "gpumem memory report" in out
    assert re.search(r"^  segments\s+growable$", out, re.MULTILINE)


@pytest.fixture
def info_devices(monkeypatch):
    """`gpumem info` in this process over `count` fake 8 GiB devices, with GPUMEM_LIMIT=`limit`;
    returns its exit status and output."""
    def run(limit: str, count: int):
        fake = FakeC([8 * GiB] * count)
        use_fake_c(monkeypatch, fake)
        monkeypatch.setattr(fake, "largest_free_block", lambda d: 0, raising=False)
        monkeypatch.setenv("GPUMEM_LIMIT", limit)
        return cli.main(["info"])
    return run


@pytest.mark.parametrize("limit, reason", [
    ("9:4GB", "there is no CUDA device 9; this process sees devices 0..0"),
    ("0:9GB", "it comes to 9.00 GiB, more than the device total of 8.00 GiB"),
])
def test_info_checks_gpumem_limit_on_the_devices_there_are(info_devices, capsys, limit, reason):
    assert info_devices(limit, count=1) == 2
    out = capsys.readouterr().out
    assert f"GPUMEM_LIMIT is invalid: {reason}" in out
    assert "GPUMEM_LIMIT sets" not in out


def test_info_without_a_device_checks_the_syntax_alone(info_devices, capsys):
    assert info_devices("9:4GB", count=0) == 0
    assert info_devices("9:4XB", count=0) == 2
    assert 'GPUMEM_LIMIT is invalid: unknown unit "XB"' in capsys.readouterr().out


def test_info_shows_only_the_devices_gpumem_limit_names(info_devices, capsys):
    assert info_devices("1:2GB", count=2) == 0
    out = capsys.readouterr().out
    assert "GPUMEM_LIMIT sets" not in out.split("device 1: ")[0]
    assert "GPUMEM_LIMIT sets 2.00 GiB" in out.split("device 1: ")[1]


@pytest.mark.parametrize("limit", ["4GB", "50%", "none", "0:1GB", "9:4GB", "0:9GB", "1:1GB", "4XB", "0:1GB,0:2GB"])
def test_info_and_a_program_under_gpumem_limit_give_the_same_verdict(hook_devices, monkeypatch, capsys, limit):
    fake = hook_devices(limit, count=1)
    monkeypatch.setattr(fake, "largest_free_block", lambda d: 0, raising=False)
    info_refuses = cli.main(["info"]) == 2
    try:
        _autoload.install()
        fake.malloc(0, 1 << 20)  # the devices' first use: where the rest of GPUMEM_LIMIT is checked
        program_refused = False
    except (SystemExit, ValueError):
        program_refused = True
    capsys.readouterr()
    assert info_refuses == program_refused


def test_info_escapes_and_cuts_a_hostile_gpumem_limit(info_devices, capsys):
    assert info_devices("\x1b[31m" + "9" * 10_000_000, count=1) == 2
    out = capsys.readouterr().out
    assert "\x1b" not in out and len(out) < 5000
    assert "GPUMEM_LIMIT: '\\x1b[31m999" in out and "… (10000005 characters)" in out


# ---- run, as a shell runs a program -------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_run_starts_the_program_with_the_signals_a_shell_gives_it():
    # Python ignores SIGPIPE and SIGXFSZ; a program gpumem starts must not inherit that.
    shell = [sys.executable, "-c", "import subprocess; print(subprocess.run(['grep', 'SigIgn', '/proc/self/status'], "
             "capture_output=True, text=True).stdout)"]
    as_from_a_shell = subprocess.run(shell, capture_output=True, text=True).stdout.strip()
    completed = gpumem("run", "--limit", "4GB", "--", "grep", "SigIgn", "/proc/self/status")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == as_from_a_shell


def test_run_a_program_writing_to_a_closed_pipe_dies_of_sigpipe():
    # `gpumem run -- yes | head -n 1`: yes ends by SIGPIPE, silently, as it does from a shell.
    child = subprocess.Popen([sys.executable, "-m", "gpumem", "run", "--limit", "4GB", "--", "yes"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout.readline() == b"y\n"
    child.stdout.close()
    assert child.wait(timeout=300) == -signal.SIGPIPE
    assert b"Broken pipe" not in child.stderr.read()


def test_run_of_a_script_without_a_shebang_runs_it_through_sh(tmp_path):
    script = tmp_path / "job"
    script.write_text('echo "ran $0 with $# args: $*, limit $GPUMEM_LIMIT"\nexit 7\n')
    script.chmod(0o755)
    completed = gpumem("run", "--limit", "4GB", "--", str(script), "a", "b c")
    assert completed.returncode == 7, completed.stderr
    assert completed.stdout == f"ran {script} with 2 args: a b c, limit 4GB\n"


def test_run_finds_a_script_without_a_shebang_on_path(tmp_path):
    (tmp_path / "job").write_text("echo found on PATH\n")
    (tmp_path / "job").chmod(0o755)
    search_path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    completed = gpumem("run", "--limit", "4GB", "--", "job", env={"PATH": search_path})
    assert (completed.returncode, completed.stdout) == (0, "found on PATH\n"), completed.stderr


@pytest.mark.parametrize("make, reason", [
    (lambda path: path.write_text("echo hi\n"), "Permission denied"),  # not executable
    (lambda path: path.mkdir(), "it is a directory"),
    (lambda path: (path.write_text("#!/no/such/interpreter\n"), path.chmod(0o755)),
     "the interpreter its #! line names was not found"),
], ids=["not-executable", "directory", "bad-interpreter"])
def test_run_of_a_program_that_cannot_be_executed_exits_126_saying_why(tmp_path, make, reason):
    path = tmp_path / "program"
    make(path)
    completed = gpumem("run", "--limit", "4GB", "--", str(path))
    assert completed.returncode == 126
    assert completed.stderr == f"gpumem: error: program {str(path)!r} cannot be executed: {reason}\n"


def test_run_of_a_program_found_on_path_but_not_executable_names_the_file(tmp_path):
    (tmp_path / "job").write_text("echo hi\n")
    completed = gpumem("run", "--limit", "4GB", "--", "job", env={"PATH": str(tmp_path)})
    assert completed.returncode == 126
    assert f"program 'job' ({str(tmp_path / 'job')!r}) cannot be executed: Permission denied" in completed.stderr


def test_run_of_an_empty_program_name_exits_127():
    completed = gpumem("run", "--limit", "4GB", "--", "")
    assert (completed.returncode, completed.stderr) == (127, "gpumem: error: program '' was not found\n")


# ---- replay: arguments and the plot ---------------------------------------------------------------


@pytest.mark.parametrize("precision", ["0", "none", "50%", "0.5"])
def test_replay_precision_that_is_not_a_positive_size_says_what_precision_takes(precision):
    completed = gpumem("replay", data("big_blocks"), "--min-limit", "--precision", precision)
    assert_usage_error(completed, f"argument --precision: '{precision}' is not a positive size in bytes "
                                  "(give e.g. 1MiB)")
    assert "bad limit" not in completed.stderr


@pytest.mark.parametrize("device", ["\u0663", "\u00b2", "1\u0660", " 1", "+1", "9" * 5000])
def test_replay_device_takes_ascii_digits_only(device):
    completed = gpumem("replay", data("two_devices"), "--limit", "1GB", "--device", device)
    assert_usage_error(completed, "is not a device index (0, 1, ... in ASCII digits)")


def test_replay_plot_failure_is_named_and_keeps_the_replays_output(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "no-such-folder" / "memory.png"
    completed = gpumem("replay", data("big_blocks"), "--limit", "500MB", "--plot", str(path))
    assert completed.returncode == 2
    assert value_of(completed.stdout, "result").startswith("FAILED: ")  # the replay's verdict, as without --plot
    assert completed.stderr == (f"gpumem: error: the plot could not be written to {str(path)!r}: "
                                "No such file or directory\n")


def test_replay_plot_of_a_replay_with_no_timeline_gives_replay_advice(monkeypatch, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    real = replay.replay

    def without_timeline(*args, **kwargs):
        result = real(*args, **kwargs)
        result.timeline.clear()
        return result

    monkeypatch.setattr(replay, "replay", without_timeline)
    assert cli.main(["replay", data("train_like"), "--limit", "400MB", "--plot", str(tmp_path / "m.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpumem: error: the plot could not be written to ")
    assert "replay" in err and "timeline.start" not in err


# ---- the user's text in messages ----------------------------------------------------------------------


def test_control_characters_in_a_limit_are_escaped_in_the_error():
    completed = gpumem("run", "--limit", "4\x1b[31mXB", "--", "true")
    assert_usage_error(completed, 'bad limit "4\\x1b[31mXB"')
    assert "\x1b" not in completed.stderr


def test_a_long_limit_is_cut_in_the_error():
    completed = gpumem("replay", data("big_blocks"), "--limit", "9" * 100_000 + "XB")
    assert_usage_error(completed, 'bad limit "' + "9" * 64 + '"… (100002 characters)')
    assert len(completed.stderr) < 3000


def test_control_characters_in_unknown_arguments_are_escaped():
    completed = gpumem("replay", data("big_blocks"), "--limit", "1GB", "\x1b]0;owned\x07")
    assert_usage_error(completed, "unrecognized arguments: \\x1b]0;owned\\x07")
    assert "\x1b" not in completed.stderr


# ---- replay of hostile files, in this process -----------------------------------------------------


def replayed(capsys, *args: str) -> tuple[int, str, list[str]]:
    """cli.main(["replay", *args]): its status, its stdout and its stderr's lines."""
    status = cli.main(["replay", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err.splitlines()


def huge_sizes(tmp_path) -> str:
    """Eight blocks alive before the trace of 2^62 bytes each (the most one size may be): 2^65 in all."""
    segments = [{"device": 0, "address": n << 40, "total_size": 1 << 62, "allocated_size": 1 << 62,
                 "blocks": [{"address": n << 40, "size": 1 << 62, "state": "active_allocated"}]} for n in range(8)]
    events = [{"action": "alloc", "addr": 1 << 63, "size": 512, "stream": 0, "time_us": 1}]
    path = tmp_path / "huge.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [events]}))
    return str(path)


def test_replay_of_sizes_adding_up_past_2_to_the_64_is_refused_in_one_line(tmp_path, capsys):
    status, _, err = replayed(capsys, huge_sizes(tmp_path))
    assert status == 2
    [line] = err
    assert line.startswith("gpumem: error: the device the trace needs (twice its peak) (67108864.00 TiB) is not")
    assert "--device-total" in line and "internal error" not in line


@pytest.mark.parametrize("mode", [[], ["--min-limit"], ["--limit", "1GB"]], ids=["uncapped", "min-limit", "limit"])
def test_replay_of_sizes_adding_up_past_2_to_the_64_on_a_given_device_prints_them(tmp_path, capsys, mode):
    status, out, err = replayed(capsys, huge_sizes(tmp_path), "--device-total", "80GB", *mode)
    assert status == 1 and err == []
    assert "none: the trace does not fit" in out if mode == ["--min-limit"] else "33554432.00 TiB" in out


def sparse_snapshot(tmp_path, size: int) -> str:
    path = tmp_path / "sparse.pickle"
    with open(path, "wb") as file:
        file.write(b"\x80\x04")
        file.truncate(size)
    return str(path)


def test_replay_of_a_file_past_the_cap_is_refused_by_its_size_in_one_line(tmp_path, capsys):
    path = sparse_snapshot(tmp_path, GiB)
    status, _, err = replayed(capsys, path)
    assert status == 2
    assert err == [f"gpumem: error: {path}: is {GiB} bytes, larger than the cap of {256 * MiB} bytes (256 MiB) on "
                   "a snapshot file; a larger one is max_size of gpumem.snapshot_file.load, --max-size of gpumem "
                   "replay"]


def test_replay_max_size_raises_the_cap(tmp_path, capsys):
    path = sparse_snapshot(tmp_path, GiB)
    status, _, [line] = replayed(capsys, path, "--max-size", "2GB")
    assert status == 2 and "it holds the byte 0x00, which is no opcode" in line and "(the opcode at byte 2)" in line


@pytest.mark.parametrize("size", ["5%", "0", "none", "huge"])
def test_replay_max_size_must_be_a_size_in_bytes(tmp_path, capsys, size):
    with pytest.raises(SystemExit) as caught:
        cli.main(["replay", sparse_snapshot(tmp_path, 10), "--max-size", size])
    assert caught.value.code == 2
    assert "is not a positive size in bytes" in capsys.readouterr().err


def test_info_with_a_gpumem_limit_that_is_not_utf_8_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("GPUMEM_LIMIT", "\udcff")
    assert cli.main(["info"]) == 2
    captured = capsys.readouterr()
    assert "GPUMEM_LIMIT is invalid: it holds the byte 0xff (character 1), which is not UTF-8 text" in captured.out
    assert captured.err == ""


@pytest.mark.parametrize("args", [["run", "--limit", "\udcff", "--", "true"],
                                  ["replay", "x.pickle", "--limit", "4\udcffGB"],
                                  ["replay", "x.pickle", "--precision", "\udcff"]],
                         ids=["run-limit", "replay-limit", "replay-precision"])
def test_an_argument_that_is_not_utf_8_is_a_usage_error_in_one_line(capsys, args):
    with pytest.raises(SystemExit) as caught:
        cli.main(args)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err and "\\udcff" in err
