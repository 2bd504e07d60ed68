"""GPUMEM_LIMIT without code changes: gpumem-autoload.pth and the hook on torch's import, on a CPU.

The start-up side runs in fresh interpreters, as a user's program would; what the hook does once
torch is imported (gpumem._autoload.install) also runs in this process, over fake devices.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import site
import statistics
import subprocess
import sys
import sysconfig
import time

import pytest

from fake_c import GiB
from gpumem import _C, _autoload

PTH = "gpumem-autoload.pth"
# What a program reports once it has run: is gpumem loaded, and what did the hook do.
REPORT = ("import json, sys; autoload = sys.modules.get('gpumem._autoload'); "
          "print(json.dumps(['gpumem' in sys.modules, getattr(autoload, 'state', None)]))")
# The hook installs gpumem with or without a GPU: installing asks no device.
EXPECTED_STATE = "installed"


def python(code: str, limit: str | None = None, *options: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter, with GPUMEM_LIMIT=`limit` (unset for None)."""
    env = {name: value for name, value in os.environ.items() if name != "GPUMEM_LIMIT"}
    if limit is not None:
        env["GPUMEM_LIMIT"] = limit
    return subprocess.run([sys.executable, *options, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def reported(completed: subprocess.CompletedProcess):
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def gpumem_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "gpumem" in line]


# ---- what pip installs --------------------------------------------------------------------------


def test_the_hook_file_is_installed_at_the_top_of_site_packages():
    installed = [f for f in importlib.metadata.files("gpumem") or [] if f.name == PTH]
    assert installed, f"{PTH} is not among gpumem's installed files (pip install --no-build-isolation .)"
    path = pathlib.Path(installed[0].locate())
    site_dirs = {pathlib.Path(d).resolve() for d in [*site.getsitepackages(), site.getusersitepackages()]}
    assert path.parent.resolve() in site_dirs
    assert path.read_text().strip().splitlines() == [
        'import os; ("GPUMEM_LIMIT" in os.environ or "GPUMEM_SHARE" in os.environ or "GPUMEM_FLOOR" in os.environ) '
        'and __import__("_gpumem_autoload").hook()'
    ]


# ---- start-up without GPUMEM_LIMIT --------------------------------------------------------------


def test_without_gpumem_limit_start_up_imports_neither_torch_nor_gpumem():
    completed = python("import sys; print('torch' in sys.modules, 'gpumem' in sys.modules, "
                       "'_gpumem_autoload' in sys.modules)")
    assert completed.stdout.split() == ["False", "False", "False"]


def test_without_gpumem_limit_the_import_time_log_has_no_gpumem_or_torch_module():
    completed = python("pass", None, "-X", "importtime")
    assert completed.returncode == 0, completed.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in completed.stderr.splitlines() if "|" in line]
    assert "site" in imported  # the log covers start-up, .pth files included
    assert not [name for name in imported if "gpumem" in name or name.split(".")[0] == "torch"]


def test_with_gpumem_limit_start_up_loads_only_the_small_hook_module():
    completed = python("pass", "4GB", "-X", "importtime")
    imported = [line.rsplit("|", 1)[-1].strip() for line in completed.stderr.splitlines() if "|" in line]
    assert "_gpumem_autoload" in imported
    assert not [name for name in imported if name.startswith("gpumem") or name.split(".")[0] == "torch"]


# The interpreter starts without site (-S), then runs site.main() itself, processing every .pth
# but, for "without", gpumem's: the two differ in the hook alone.
_STARTED_BY_HAND = ("import site; add = site.addpackage; "
                    "site.addpackage = lambda d, name, known: known if name == {skip!r} else add(d, name, known); "
                    "site.main(); import sys; print('_gpumem_autoload' in sys.modules)")


def test_the_start_up_runs_differ_in_the_hook_alone_and_their_times_are_printed(capsys):
    with_hook, without_hook = _STARTED_BY_HAND.format(skip=""), _STARTED_BY_HAND.format(skip=PTH)
    # The comparison is sound: the "with" run does process gpumem's .pth, the "without" run does not.
    assert python(with_hook, "4GB", "-S").stdout.split() == ["True"]
    assert python(without_hook, "4GB", "-S").stdout.split() == ["False"]
    runs = {"without the hook": (without_hook, None), "with the hook, GPUMEM_LIMIT unset": (with_hook, None),
            "with the hook, GPUMEM_LIMIT=4GB": (with_hook, "4GB")}
    times = {name: [] for name in runs}
    for _ in range(20):  # interleaved, so that a busy moment hits every variant alike
        for name, (code, limit) in runs.items():
            start = time.perf_counter()
            python(code, limit, "-S")
            times[name].append(time.perf_counter() - start)
    with capsys.disabled():  # a figure to read, not an assertion: benchmarks judge speed, tests do not
        print("\ninterpreter start-up, median of 20 runs of `python -S -c <site.main()>`:")
        for name, seconds in times.items():
            print(f"  {name:<36} {statistics.median(seconds) * 1e3:7.2f} ms")


# ---- GPUMEM_LIMIT set: the hook on torch's import -----------------------------------------------


def test_a_program_that_never_imports_torch_imports_neither_torch_nor_gpumem():
    completed = python("import sys; print('torch' in sys.modules, 'gpumem' in sys.modules)", "4GB")
    assert completed.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("first_import", ["import torch", "import torch.nn.functional", "from torch import nn",
                                          "import gpumem"])
def test_importing_torch_installs_gpumem_whatever_imports_it_first(first_import):
    assert reported(python(f"{first_import}\n{REPORT}", "4GB")) == [True, EXPECTED_STATE]


def test_torch_keeps_its_own_loader():
    code = ("import torch; "
            "print(type(torch.__loader__).__name__, torch.__spec__.loader is torch.__loader__)")
    assert python(code, "4GB").stdout.split() == ["SourceFileLoader", "True"]


def test_the_hook_leaves_the_import_system_once_it_has_run():
    code = "import sys, torch; print([type(f).__name__ for f in sys.meta_path])"
    assert "_TorchFinder" not in python(code, "4GB").stdout


@pytest.mark.skipif(_C.device_count() > 0, reason="checks the machine without a CUDA device")
@pytest.mark.parametrize("limit", ["4GB", "50%", "3:1GB"])
def test_without_a_cuda_device_a_torch_program_runs_on_and_nothing_is_printed(limit):
    # Nothing asks a device until CUDA is used, so limits that need one are never looked at.
    completed = python(f"import torch\nprint(torch.ones(3).sum().item())\n{REPORT}", limit)
    assert completed.stdout.splitlines()[0] == "3.0"
    assert reported(completed) == [True, "installed"]
    assert gpumem_lines(completed.stderr) == []


@pytest.mark.parametrize("value, reason", [
    ("4XB", 'unknown unit "XB"'),
    ("", "it is empty"),
    ("150%", "a percentage must be above 0 and at most 100"),
    ("0:4GB,0:8GB", "device 0 is listed twice"),
    ("1:-1GB", "a limit cannot be negative"),
])
def test_a_bad_limit_stops_a_torch_program_at_import_with_status_2(value, reason):
    completed = python("import torch\nprint('the program ran')", value)
    assert completed.returncode == 2
    assert "the program ran" not in completed.stdout
    [line] = gpumem_lines(completed.stderr)
    assert line.startswith(f'gpumem: bad GPUMEM_LIMIT "{value}": ')
    assert reason in line and "Accepted forms" in line and "unset it" in line
    assert "Traceback" not in completed.stderr


def test_a_bad_limit_does_not_stop_a_program_that_never_imports_torch():
    # See Note [when a bad GPUMEM_LIMIT is caught] in gpumem/_autoload.py.
    completed = python("print('ran')", "4XB")
    assert completed.returncode == 0 and completed.stdout.strip() == "ran"


def test_gpumem_run_caps_a_program_that_never_imports_gpumem():
    program = f"import torch\n{REPORT}"
    completed = subprocess.run(
        [sys.executable, "-m", "gpumem", "run", "--limit", "4GB", "--", sys.executable, "-c", program],
        env={n: v for n, v in os.environ.items() if n != "GPUMEM_LIMIT"}, capture_output=True, text=True,
        timeout=300)
    assert reported(completed) == [True, EXPECTED_STATE]


@pytest.mark.parametrize("command", [[sys.executable, "-m", "gpumem"],
                                     [os.path.join(sysconfig.get_path("scripts"), "gpumem")]])
def test_the_gpumem_command_reads_a_bad_limit_itself(command):
    # `gpumem info` reports a bad GPUMEM_LIMIT (exit 2) rather than being stopped by the hook.
    if not os.path.exists(command[0]):
        pytest.skip(f"{command[0]} is not installed")
    env = {**os.environ, "GPUMEM_LIMIT": "4XB"}
    completed = subprocess.run([*command, "info"], env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2, completed.stderr
    assert 'GPUMEM_LIMIT is invalid: unknown unit "XB"' in completed.stdout
    assert gpumem_lines(completed.stderr) == []


# The wrapper pip writes for the console script gpumem = "gpumem.cli:main".
CONSOLE_SCRIPT = f"""#!{sys.executable}
# -*- coding: utf-8 -*-
import re
import sys
from _gpumem_command import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""


@pytest.mark.parametrize("name", ["gpumem", "gpumem-renamed"])
def test_the_console_script_is_known_by_what_it_runs_not_by_its_name(tmp_path, name):
    script = tmp_path / name
    script.write_text(CONSOLE_SCRIPT)
    script.chmod(0o755)
    completed = subprocess.run([str(script), "info"], env={**os.environ, "GPUMEM_LIMIT": "4XB"},
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2, completed.stderr
    assert 'GPUMEM_LIMIT is invalid: unknown unit "XB"' in completed.stdout
    assert gpumem_lines(completed.stderr) == []  # the hook left it alone: no `gpumem: bad GPUMEM_LIMIT` line


def test_a_users_script_named_gpumem_gets_the_hook(tmp_path):
    script = tmp_path / "gpumem"
    script.write_text(f"import torch\n{REPORT}\n")
    assert reported(python_file(script, "4GB")) == [True, "installed"]
    completed = python_file(script, "4XB")
    assert completed.returncode == 2
    [line] = gpumem_lines(completed.stderr)
    assert line.startswith('gpumem: bad GPUMEM_LIMIT "4XB": ')


def test_a_script_that_imports_torch_before_the_cli_gets_the_hook(tmp_path):
    script = tmp_path / "gpumem"
    script.write_text(f"import torch\nfrom gpumem.cli import main\n{REPORT}\n")
    assert reported(python_file(script, "4GB")) == [True, "installed"]


def python_file(path: pathlib.Path, limit: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(path)], env={**os.environ, "GPUMEM_LIMIT": limit},
                          capture_output=True, text=True, timeout=300)


# ---- install(), over fake devices ---------------------------------------------------------------


@pytest.fixture
def devices(hook_devices):
    """Fake devices (8 GiB each) and GPUMEM_LIMIT; returns the fake _C."""
    return hook_devices


def test_install_applies_one_limit_to_every_device(devices):
    fake = devices("1GB")
    _autoload.install()
    assert fake.installed and fake.limits() == [1 * GiB, 1 * GiB]
    assert _autoload.state == "installed"


def test_install_applies_per_device_limits(devices):
    fake = devices("0:1GB,1:25%")
    _autoload.install()
    assert fake.limits() == [1 * GiB, 2 * GiB]


def test_install_asks_no_device_and_hands_the_settings_on(devices):
    fake = devices("0:1GB,1:25%", segments="plain")
    _autoload.install()
    assert fake.install_args == [("0:1GB,1:25%", False)]
    assert fake.device_count_calls == 0


def test_a_limit_larger_than_the_device_is_an_error_at_first_use_naming_it(devices):
    fake = devices("0:9GB")
    _autoload.install()
    assert fake.installed and _autoload.state == "installed"
    for _ in range(2):  # and at every use after: nothing is handed out without the cap
        with pytest.raises(ValueError) as caught:
            fake.malloc(0, 1 << 20)
        assert str(caught.value).startswith('gpumem: bad GPUMEM_LIMIT "0:9GB": ')
        assert "fix GPUMEM_LIMIT or unset it" in str(caught.value)


def test_a_device_that_is_not_there_is_an_error_at_first_use_naming_it(devices):
    fake = devices("2:1GB")
    _autoload.install()
    with pytest.raises(ValueError) as caught:
        fake.get_limit(0)
    assert str(caught.value).startswith('gpumem: bad GPUMEM_LIMIT "2:1GB": there is no CUDA device 2; '
                                        "this process sees devices 0..1")


def test_without_a_device_it_installs_and_prints_nothing(devices, capsys):
    fake = devices("0:4GB", count=0)
    _autoload.install()
    assert fake.installed and _autoload.state == "installed"
    assert capsys.readouterr() == ("", "")


def test_a_syntax_error_stops_even_without_a_device(devices, stopped):
    devices("4XB", count=0)
    assert stopped().startswith('gpumem: bad GPUMEM_LIMIT "4XB": unknown unit "XB". Accepted forms: ')


def test_a_program_named_gpumem_is_not_left_alone_for_its_name(devices, monkeypatch):
    fake = devices("1GB")
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/gpumem", "info"])
    _autoload.install()
    assert fake.installed and _autoload.state == "installed"


@pytest.mark.parametrize("value, shown", [
    ("4\x1b[31mXB", '"4\\x1b[31mXB"'),
    ('4"XB', '"4\\"XB"'),
    ("9" * 10_000_000, '"' + "9" * 64 + '"… (10000000 characters)'),
], ids=["control", "quote", "ten-megabytes"])
def test_the_stop_line_shows_a_hostile_value_escaped_and_cut(devices, stopped, value, shown):
    devices(value)
    line = stopped()
    assert line.startswith(f"gpumem: bad GPUMEM_LIMIT {shown}: ")
    assert line.endswith("The program stops rather than run without the cap: fix GPUMEM_LIMIT or unset it.")
    assert "\x1b" not in line and len(line) < 2000


SETTINGS_OF_WORDS = ["GPUMEM_SEGMENTS", "GPUMEM_CHUNK", "GPUMEM_SCOPE", "GPUMEM_MEM_INFO", "GPUMEM_WARN_AT", "GPUMEM_METRICS_PORT",
                     "GPUMEM_PUBLISH", "GPUMEM_METRICS_ADDR"]


def test_a_limit_that_is_not_utf_8_stops_a_torch_program_at_import_with_status_2():
    completed = python("import torch\nprint('the program ran')", "\udcff")  # the byte 0xff, as the shell passes it
    assert completed.returncode == 2 and "the program ran" not in completed.stdout
    [line] = gpumem_lines(completed.stderr)
    assert line.startswith('gpumem: bad GPUMEM_LIMIT "\\udcff": it holds the byte 0xff (character 1), which is not '
                           "UTF-8 text. Accepted forms: ")
    assert "Traceback" not in completed.stderr


def test_the_stop_line_names_a_byte_of_gpumem_limit_that_is_not_utf_8(devices, stopped):
    fake = devices("0:4GB,1:\udcfe")
    line = stopped()
    assert line.startswith('gpumem: bad GPUMEM_LIMIT "0:4GB,1:\\udcfe": it holds the byte 0xfe (character 9), '
                           "which is not UTF-8 text. Accepted forms: ")
    assert not fake.installed


@pytest.mark.parametrize("variable", SETTINGS_OF_WORDS)
def test_a_setting_that_is_not_utf_8_stops_the_program_naming_the_byte_and_the_forms(devices, stopped, monkeypatch,
                                                                                     variable):
    fake = devices("1GB")
    monkeypatch.setenv(variable, "\udcff")
    line = stopped()
    assert line.startswith(f'gpumem: bad {variable} "\\udcff": it holds the byte 0xff (character 1), which is not '
                           "UTF-8 text; give ")
    assert not fake.installed


def test_a_run_dir_that_is_not_utf_8_is_a_path_like_any_other(devices, monkeypatch, tmp_path):
    fake = devices("1GB")
    monkeypatch.setenv("GPUMEM_RUN_DIR", str(tmp_path) + "/\udcff")  # Linux paths may hold any byte
    _autoload.install()
    assert fake.installed
