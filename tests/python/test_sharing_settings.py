"""Sharing a GPU turned on by its settings alone: GPUMEM_SHARE and GPUMEM_FLOOR at torch's import
(fresh interpreters, as a user's program starts), `gpumem run --share/--floor`, what they mean at
torch's CUDA init (gpumem.sharing.start_for_environment, over fake devices: no GPU here), and a
forked child that must not leave its parent's table. test_gpu_sharing.py runs the same on a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import environment_without_gpumem_settings
from fake_c import GiB, FakeC, use_fake_c
from gpumem import _autoload, sharing
from gpumem.monitoring import startup
from gpumem.settings import floors

# What a program reports once it has run: is gpumem loaded, what did the hook do, is it the allocator.
REPORT = ("import json, sys; autoload = sys.modules.get('gpumem._autoload'); gpumem = sys.modules.get('gpumem'); "
          "print(json.dumps([getattr(autoload, 'state', None), bool(gpumem and gpumem.is_enabled())]))")
FORMS = floors.floor_forms()


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, with these gpumem settings and no other."""
    return subprocess.run([sys.executable, "-c", code], env={**environment_without_gpumem_settings(), **env},
                          capture_output=True, text=True, timeout=300)


def gpumem(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumem", *args], env={**environment_without_gpumem_settings(), **env},
                          capture_output=True, text=True, timeout=300)


def reported(completed: subprocess.CompletedProcess):
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def gpumem_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "gpumem" in line]


# ---- at torch's import ---------------------------------------------------------------------------


@pytest.mark.parametrize("variable, value", [("GPUMEM_SHARE", "on"), ("GPUMEM_SHARE", " ON "),
                                             ("GPUMEM_FLOOR", "10GB"), ("GPUMEM_FLOOR", "0:20GB,1:none")])
def test_a_sharing_variable_alone_installs_gpumem_at_torchs_import(variable, value):
    assert reported(python(f"import torch\n{REPORT}", **{variable: value})) == ["installed", True]


def test_gpumem_share_off_alone_installs_nothing():
    assert reported(python(f"import torch\n{REPORT}", GPUMEM_SHARE="off")) == ["not run", False]


@pytest.mark.parametrize("variable", ["GPUMEM_SHARE", "GPUMEM_FLOOR"])
def test_with_a_sharing_variable_start_up_loads_only_the_small_hook_module(variable):
    completed = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                               env={**environment_without_gpumem_settings(), variable: "on"}, timeout=300)
    imported = [line.rsplit("|", 1)[-1].strip() for line in completed.stderr.splitlines() if "|" in line]
    assert "_gpumem_autoload" in imported
    assert not [name for name in imported if name.startswith("gpumem") or name.split(".")[0] == "torch"]


@pytest.mark.parametrize("env, start", [
    ({"GPUMEM_SHARE": "maybe"}, 'gpumem: bad GPUMEM_SHARE "maybe": give "on" or "off". The program stops rather '
                                "than guess whether to share the GPU: fix GPUMEM_SHARE or unset it."),
    ({"GPUMEM_FLOOR": "20XB"}, f'gpumem: bad GPUMEM_FLOOR "20XB": unknown unit "XB". Accepted forms: {FORMS}. The '
                               "program stops rather than run without the floor it asked for: fix GPUMEM_FLOOR or "
                               "unset it."),
    ({"GPUMEM_FLOOR": "20XB", "GPUMEM_SHARE": "off"}, 'gpumem: bad GPUMEM_FLOOR "20XB": unknown unit "XB".'),
    ({"GPUMEM_FLOOR": "0:2GB,0:4GB"}, 'gpumem: bad GPUMEM_FLOOR "0:2GB,0:4GB": device 0 is listed twice.'),
    ({"GPUMEM_SHARE": "on", "GPUMEM_SEGMENTS": "fast"}, 'gpumem: bad GPUMEM_SEGMENTS "fast": give '),
], ids=["share", "floor", "floor-share-off", "floor-twice", "segments-beside-share"])
def test_a_bad_sharing_setting_stops_a_torch_program_at_import_with_status_2(env, start):
    completed = python("import torch\nprint('the program ran')", **env)
    assert completed.returncode == 2
    assert "the program ran" not in completed.stdout and "Traceback" not in completed.stderr
    [line] = gpumem_lines(completed.stderr)
    assert line.startswith(start)


def test_a_bad_sharing_setting_does_not_stop_a_program_that_never_imports_torch():
    completed = python("print('ran')", GPUMEM_SHARE="maybe")
    assert completed.returncode == 0 and completed.stdout.strip() == "ran"


def test_the_gpumem_command_reads_a_bad_sharing_setting_itself():
    completed = gpumem("info", GPUMEM_SHARE="maybe")
    assert completed.returncode == 2, completed.stderr
    assert 'GPUMEM_SHARE is invalid: give "on" or "off"' in completed.stdout
    assert gpumem_lines(completed.stderr) == []


@pytest.fixture
def hook(monkeypatch):
    """The autoload hook about to run over two fake 8 GiB devices, no gpumem setting yet; what it
    queues for torch's CUDA init is kept in `hook.queued` instead."""
    fake = FakeC([8 * GiB, 8 * GiB])
    use_fake_c(monkeypatch, fake)
    for variable in _autoload.ARMING:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(_autoload, "state", "not run")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    fake.queued = []
    monkeypatch.setattr(startup.torch.cuda, "_lazy_call", fake.queued.append)
    return fake


def test_gpumem_share_alone_installs_without_a_cap_and_queues_sharing_first(hook, monkeypatch):
    monkeypatch.setenv("GPUMEM_SHARE", "on")
    monkeypatch.setenv("GPUMEM_PUBLISH", "1")
    _autoload.install()
    assert hook.installed and hook.install_args == [(None, None)]
    assert hook.limits() == [8 * GiB, 8 * GiB]
    # Queued first: while it raises, torch's CUDA init stops before the monitoring starts.
    assert hook.queued[0] is sharing.start_for_environment


# ---- gpumem run --share / --floor ------------------------------------------------------------------


PRINT_SETTINGS = "import os; print(os.environ.get('GPUMEM_SHARE'), os.environ.get('GPUMEM_FLOOR'), " \
                 "os.environ.get('GPUMEM_LIMIT'))"


@pytest.mark.parametrize("options, settings", [(["--share"], "on None None"), (["--floor", "20GB"], "None 20GB None"),
                                               (["--share", "--floor", "0:2GB", "--limit", "4GB"], "on 0:2GB 4GB")])
def test_run_starts_the_program_with_the_sharing_settings_and_no_limit_unless_given(options, settings):
    completed = gpumem("run", *options, "--", sys.executable, "-c", PRINT_SETTINGS)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == settings


def test_run_share_installs_gpumem_in_a_program_that_never_imports_it():
    completed = gpumem("run", "--share", "--", sys.executable, "-c", f"import torch\n{REPORT}")
    assert reported(completed) == ["installed", True]


@pytest.mark.parametrize("floor, reason", [("20XB", 'unknown unit "XB"'), ("0:1GB,0:2GB", "device 0 is listed twice"),
                                           ("\x1b[2J", "")])
def test_run_rejects_a_bad_floor_before_launching(tmp_path, floor, reason):
    marker = tmp_path / "ran"
    completed = gpumem("run", "--floor", floor, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    [line] = [line for line in completed.stderr.splitlines() if "error:" in line]
    shown = floor.replace("\x1b", "\\x1b")
    assert f'argument --floor: bad floor "{shown}": {reason}' in line and FORMS in line
    assert "\x1b" not in completed.stderr and not marker.exists()


def test_run_without_a_limit_share_or_floor_is_a_usage_error():
    completed = gpumem("run", "--", "true")
    assert completed.returncode == 2
    assert "gpumem: error: run needs --limit, --share or --floor" in completed.stderr


def test_run_help_shows_share_and_floor():
    completed = gpumem("run", "--help")
    assert completed.returncode == 0
    assert completed.stdout.startswith("usage: gpumem run [--limit LIMIT] [--scope SCOPE] [--share] [--floor FLOOR]")
    assert "GPUMEM_SHARE=on" in completed.stdout and "GPUMEM_FLOOR" in completed.stdout


# ---- at torch's CUDA init: every floor checked before anything is joined ------------------------


@pytest.fixture
def cuda_start(monkeypatch, tmp_path):
    """start(environ, count=1, limit=None): gpumem.sharing.start_for_environment over `count` fake
    8 GiB devices (GPUMEM_LIMIT=`limit`), as torch's CUDA init runs it; returns the fake _C."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("GPUMEM_RUN_DIR", str(run_dir))
    monkeypatch.setattr(sharing, "gpu_uuid", lambda index: f"GPU-{index:08d}-aaaa-bbbb-cccc-dddddddddddd")
    made = []

    def start(environ: dict, count: int = 1, limit: str | None = None) -> FakeC:
        fake = FakeC([8 * GiB] * count)
        use_fake_c(monkeypatch, fake)
        fake.install(limit)
        made.append(fake)
        sharing.start_for_environment(environ)
        return fake

    start.made = made
    start.run_dir = run_dir
    return start


def refused(cuda_start, environ: dict, **where) -> str:
    """The error start_for_environment raises; nothing may have been joined."""
    with pytest.raises((ValueError, RuntimeError)) as raised:
        cuda_start(environ, **where)
    [fake] = cuda_start.made
    assert fake.joined == [] and fake.floors == {}
    message = str(raised.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("environ, start", [
    ({"GPUMEM_FLOOR": "5:8GB"}, 'gpumem: bad GPUMEM_FLOOR "5:8GB" on device 5: there is no CUDA device 5; this process '
                                "sees devices 0..0 (CUDA_VISIBLE_DEVICES applies). Accepted forms: "),
    ({"GPUMEM_FLOOR": "200GB"}, 'gpumem: bad GPUMEM_FLOOR "200GB" on device 0: it comes to 200.00 GiB, more than the '
                                "device total of 8.00 GiB. Accepted forms: "),
    ({"GPUMEM_FLOOR": "0:none,1:2GB", "GPUMEM_SHARE": "on"}, 'gpumem: bad GPUMEM_FLOOR "0:none,1:2GB" on device 1: '
                                                             "there is no CUDA device 1"),
], ids=["missing-device", "above-the-device", "missing-after-a-good-one"])
def test_a_floor_that_does_not_fit_the_devices_stops_cuda_init(cuda_start, environ, start):
    message = refused(cuda_start, environ)
    assert message.startswith(start)
    assert FORMS in message and message.endswith("fix GPUMEM_FLOOR or unset it, and start the program again.")


def test_a_floor_above_the_hard_cap_stops_cuda_init(cuda_start):
    message = refused(cuda_start, {"GPUMEM_FLOOR": "6GB"}, limit="4GB")
    assert message.startswith('gpumem: bad GPUMEM_FLOOR "6GB" on device 0: it comes to 6.00 GiB, above the hard cap '
                              "of 4.00 GiB: a floor is at most the limit. Accepted forms: ")


def test_every_devices_floor_is_checked_before_any_device_joins(cuda_start):
    message = refused(cuda_start, {"GPUMEM_FLOOR": "0:2GB,1:20GB"}, count=2)
    assert "on device 1: it comes to 20.00 GiB" in message


def test_a_table_that_cannot_be_joined_stops_cuda_init_and_leaves_what_was_joined(cuda_start, monkeypatch):
    real = FakeC.share_join

    def full_on_1(fake, device, path):
        if device == 1:
            raise RuntimeError("gpumem: sharing: 64 processes share the GPU already")
        real(fake, device, path)

    monkeypatch.setattr(FakeC, "share_join", full_on_1)
    message = refused(cuda_start, {"GPUMEM_SHARE": "on"}, count=2)
    assert message.startswith("gpumem: GPUMEM_SHARE=on asks to share the GPU, but it cannot be shared: sharing: 64 "
                              "processes share the GPU already.")


def test_a_run_dir_others_may_write_to_stops_cuda_init_before_the_table_is_opened(cuda_start):
    cuda_start.run_dir.mkdir(mode=0o1777)
    cuda_start.run_dir.chmod(0o1777)  # sticky, as /tmp: publishing may use it, a table may not
    message = refused(cuda_start, {"GPUMEM_FLOOR": "2GB"})
    assert message.startswith("gpumem: GPUMEM_FLOOR='2GB' asks to share the GPU, but it cannot be shared: sharing: the "
                              f"run directory cannot hold the GPU's table: '{cuda_start.run_dir}' is writable by other "
                              "users (mode drwxrwxrwt)")


def test_floors_that_fit_join_every_device_then_set_the_floors(cuda_start):
    fake = cuda_start({"GPUMEM_FLOOR": "1:25%"}, count=2, limit="0:4GB")
    assert [device for device, _ in fake.joined] == [0, 1]
    assert all(os.path.dirname(path) == str(cuda_start.run_dir) for _, path in fake.joined)
    assert fake.floors == {1: 2 * GiB}


def test_gpumem_share_off_without_a_floor_joins_nothing(cuda_start):
    assert cuda_start({"GPUMEM_SHARE": "off"}).joined == []


@pytest.mark.parametrize("settings, line", [
    ({"GPUMEM_FLOOR": "5:2GB"}, "GPUMEM_FLOOR is invalid on device 5: there is no CUDA device 5; this process sees "
                                "devices 0..1 (CUDA_VISIBLE_DEVICES applies)"),
    ({"GPUMEM_FLOOR": "2GB", "GPUMEM_LIMIT": "1:1GB"}, "GPUMEM_FLOOR is invalid on device 1: it comes to 2.00 GiB, "
                                                       "above the hard cap of 1.00 GiB: a floor is at most the limit"),
], ids=["missing-device", "above-the-cap"])
def test_gpumem_info_checks_a_floor_on_the_devices_as_cuda_init_does(fake_c, monkeypatch, capsys, settings, line):
    from gpumem import cli

    for variable, value in settings.items():
        monkeypatch.setenv(variable, value)
    assert cli._env_floors(2) is None
    assert capsys.readouterr().out == line + "\n"


# ---- fork -----------------------------------------------------------------------------------------


FORKED = """
import ctypes, os, subprocess, sys
from gpumem import _C, sharing
from gpumem.settings import floors

table = sys.argv[1]
member = _C.SimAllocator(8 << 30)
member.set_growable(0, False)
member.share_join(0, table)
ctypes.pythonapi.Py_IncRef(ctypes.py_object(member))  # never destroyed, as the process's allocator is not


class Tables:  # the process's tables are the simulated device's
    share_leave_all = staticmethod(member.share_leave)


sharing._C = Tables
sharing._leave_at_exit()  # what sharing.join does once the process has joined
child = os.fork()
if child == 0:
    sys.exit(0)  # the child ends normally: its atexit callbacks run
os.waitpid(child, 0)
seen = subprocess.run([sys.executable, "-c", "import sys; from gpumem import _C; o = _C.SimAllocator(8 << 30); "
                       "o.share_join(0, sys.argv[1]); print([m['pid'] for m in o.share_status(0)['others']])", table],
                      capture_output=True, text=True, check=True).stdout
print(os.getpid(), seen)
"""


def test_a_forked_child_that_exits_leaves_its_parents_table_slot_alone(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    completed = subprocess.run([sys.executable, "-c", textwrap.dedent(FORKED), str(run_dir / "t.table")],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    parent, seen = completed.stdout.split(maxsplit=1)
    assert json.loads(seen) == [int(parent)]  # another process still sees the parent as a member


def test_the_process_that_joined_leaves_at_exit(monkeypatch):
    left = []
    monkeypatch.setattr(sharing, "_C", type("Tables", (), {"share_leave_all": staticmethod(lambda: left.append(1))}))
    monkeypatch.setattr(sharing, "_joined_in", os.getpid())
    sharing._leave_if_joined_here()
    assert left == [1]
    monkeypatch.setattr(sharing, "_joined_in", os.getpid() + 1)  # as a forked child sees its parent's pid
    sharing._leave_if_joined_here()
    assert left == [1]


def test_the_autoload_hook_arms_on_the_variables_the_pth_file_names():
    import _gpumem_autoload

    assert _autoload.ARMING == _gpumem_autoload.VARIABLES == ("GPUMEM_LIMIT", "GPUMEM_SHARE", "GPUMEM_FLOOR")
