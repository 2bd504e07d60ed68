"""The `gpumem` command, run as `python -m gpumem` in a process of its own."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from gpumem import _C, cli, replay

DATA = pathlib.Path(__file__).parent / "data"
MiB = 1 << 20


def gpumem(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if name not in ("GPUMEM_LIMIT", "GPUMEM_SEGMENTS")}
    return subprocess.run([sys.executable, "-m", "gpumem", *args], env={**environment, **(env or {})},
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
    assert all(verb in completed.stdout for verb in ("info", "run", "replay"))
    assert "Exit status" in completed.stdout


@pytest.mark.parametrize("verb", ["info", "run", "replay"])
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
    (["--min-limit", "--precision", "5%"], "'5%' is not a size in bytes"),
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


def test_info_with_an_invalid_gpumem_segments_says_so_and_exits_1():
    completed = gpumem("info", env={"GPUMEM_SEGMENTS": "fast"})
    assert completed.returncode == 1
    assert 'GPUMEM_SEGMENTS is invalid: bad segment kind \'fast\': give "growable" or "plain"' in completed.stdout
    assert "Traceback" not in completed.stderr


def test_info_with_an_invalid_gpumem_limit_says_so_and_exits_1():
    completed = gpumem("info", env={"GPUMEM_LIMIT": "4XB"})
    assert completed.returncode == 1
    assert 'GPUMEM_LIMIT is invalid: bad limit "4XB"' in completed.stdout
    assert "Traceback" not in completed.stderr


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
