"""The `gpumem` command's exit statuses, as its --help lists them: each one, and no traceback ever."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from gpumem import cli
from gpumem.trace import replay

DATA = pathlib.Path(__file__).parent / "data"


def gpumem(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if not name.startswith("GPUMEM_")}
    return subprocess.run([sys.executable, "-m", "gpumem", *args], env={**environment, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def data(name: str) -> str:
    return str(DATA / f"{name}.pickle")


def test_help_lists_every_exit_status():
    epilog = gpumem("--help").stdout.split("Exit status:")[1]
    for status in ("0 ", "1 ", "2 ", "130 ", "141 ", "127 if it is not", "126 if it cannot"):
        assert status in epilog


@pytest.mark.parametrize("args, env, status", [
    (["info"], {}, 0),
    (["replay", data("big_blocks"), "--limit", "3GB"], {}, 0),
    (["replay", data("big_blocks"), "--limit", "500MB"], {}, 1),
    ([], {}, 2),
    (["shrink"], {}, 2),
    (["replay", data("big_blocks"), "--limit", "4XB"], {}, 2),
    (["replay", data("missing"), "--limit", "1GB"], {}, 2),
    (["replay", data("with_global"), "--limit", "1GB"], {}, 2),
    (["info"], {"GPUMEM_LIMIT": "4XB"}, 2),
    (["info"], {"GPUMEM_SEGMENTS": "fast"}, 2),
    (["run", "--limit", "4GB", "--", sys.executable, "-c", "raise SystemExit(3)"], {}, 3),
    (["run", "--limit", "4GB", "--", "no-such-program-gpumem"], {}, 127),
    (["run", "--limit", "4GB", "--", os.devnull], {}, 126),
    (["top", "--watch", "0"], {}, 2),
    (["top"], {"GPUMEM_RUN_DIR": "relative"}, 2),
], ids=["info", "fits", "does-not-fit", "no-verb", "unknown-verb", "bad-limit", "missing-snapshot",
        "invalid-snapshot", "info-bad-limit", "info-bad-segments", "run-passes-through", "run-not-found",
        "run-cannot-execute", "top-bad-watch", "top-bad-run-dir"])
def test_exit_status(args, env, status):
    completed = gpumem(*args, env=env)
    assert completed.returncode == status, completed.stdout + completed.stderr
    assert "Traceback" not in completed.stderr


def test_a_plot_that_cannot_be_written_exits_2(tmp_path):
    pytest.importorskip("matplotlib")
    completed = gpumem("replay", data("big_blocks"), "--limit", "3GB", "--plot", str(tmp_path / "no" / "m.png"))
    assert completed.returncode == 2 and "result" in completed.stdout and "Traceback" not in completed.stderr


def test_output_to_a_pipe_whose_reader_has_gone_exits_141_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before gpumem starts, whenever it gets to write
    child = subprocess.Popen([sys.executable, "-m", "gpumem", "replay", data("train_like")],
                             stdout=write_end, stderr=subprocess.PIPE)
    os.close(write_end)
    assert child.wait(timeout=300) == 141
    assert child.stderr.read() == b""


# ---- in this process: what no input reaches ----------------------------------------------------


@pytest.mark.parametrize("error", [RuntimeError("boom"), MemoryError("boom"), RecursionError("boom"),
                                   KeyError("boom"), AttributeError("boom")],
                         ids=lambda error: type(error).__name__)
def test_an_unexpected_exception_is_an_internal_error_with_status_2(monkeypatch, capsys, error):
    def fails(args):
        raise error

    monkeypatch.setattr(cli, "_info", fails)
    assert cli.main(["info"]) == 2
    message = str(error)
    assert capsys.readouterr().err == f"gpumem: error: internal error: {type(error).__name__}: {message}\n"


def test_an_unexpected_exception_in_a_replay_is_an_internal_error(monkeypatch, capsys):
    monkeypatch.setattr(replay, "replay", lambda *args, **kwargs: 1 / 0)
    assert cli.main(["replay", data("big_blocks"), "--limit", "3GB"]) == 2
    assert capsys.readouterr().err == "gpumem: error: internal error: ZeroDivisionError: division by zero\n"


def test_an_internal_errors_message_is_escaped_and_cut(monkeypatch, capsys):
    def fails(args):
        raise RuntimeError("\x1b[2J" + "x" * 100_000)

    monkeypatch.setattr(cli, "_info", fails)
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpumem: error: internal error: RuntimeError: \\x1b[2Jxxx")
    assert "\x1b" not in err and len(err) < 1200 and "(100004 characters)" in err


def test_an_internal_error_without_a_message_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_info", lambda args: (_ for _ in ()).throw(MemoryError()))
    assert cli.main(["info"]) == 2
    assert capsys.readouterr().err == "gpumem: error: internal error: MemoryError: (no message)\n"


@pytest.mark.parametrize("verb, args", [("_info", ["info"]),
                                        ("_replay", ["replay", data("big_blocks"), "--limit", "3GB"])])
def test_ctrl_c_exits_130_quietly(monkeypatch, capsys, verb, args):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, verb, interrupted)
    assert cli.main(args) == 130
    assert capsys.readouterr().err == ""


def test_ctrl_c_while_run_starts_the_program_exits_130_and_puts_the_signals_back(monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "execve", interrupted)
    before = signal.getsignal(signal.SIGPIPE)
    assert cli.main(["run", "--limit", "4GB", "--", "true"]) == 130
    assert capsys.readouterr().err == ""
    assert signal.getsignal(signal.SIGPIPE) == before


class _InterruptingFinder:
    """Raises KeyboardInterrupt when gpumem.cli is imported: a Ctrl-C while torch loads."""

    def find_spec(self, name, path=None, target=None):
        if name == "gpumem.cli":
            raise KeyboardInterrupt
        return None


def test_ctrl_c_while_the_command_imports_torch_exits_130_quietly(monkeypatch, capsys):
    import _gpumem_command

    monkeypatch.delitem(sys.modules, "gpumem.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_InterruptingFinder(), *sys.meta_path])
    monkeypatch.setattr(_gpumem_command, "running", False)
    assert _gpumem_command.main() == 130
    assert _gpumem_command.running is True
    assert capsys.readouterr() == ("", "")


INTERRUPTING_SITECUSTOMIZE = """
import sys

class InterruptingFinder:
    # A Ctrl-C while `python -m gpumem` loads MODULE (torch, under gpumem's __init__; or gpumem.cli).
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, InterruptingFinder())
"""


@pytest.mark.parametrize("module", ["torch", "gpumem._C", "gpumem.cli"])
def test_ctrl_c_while_python_m_gpumem_starts_exits_130_without_a_traceback(tmp_path, module):
    (tmp_path / "sitecustomize.py").write_text(INTERRUPTING_SITECUSTOMIZE.format(module=module))
    completed = gpumem("info", env={"PYTHONPATH": str(tmp_path)})
    assert completed.returncode == 130
    assert completed.stderr == "" and completed.stdout == ""


SWALLOWING_SITECUSTOMIZE = """
import signal, sys

class SwallowingFinder:
    # A Ctrl-C while torch loads, in an import that drops whatever it raises: torch's compiled
    # module imports numpy so, and a KeyboardInterrupt in there was lost or ended in numpy's traceback.
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass
        return None

sys.meta_path.insert(0, SwallowingFinder())
"""
COMMAND = "import sys, _gpumem_command; sys.argv = ['gpumem', 'info']; sys.exit(_gpumem_command.main())"


@pytest.mark.parametrize("command", [["-m", "gpumem", "info"], ["-c", COMMAND]],
                         ids=["python-m-gpumem", "console-script"])
def test_ctrl_c_while_the_command_starts_ends_it_even_where_an_import_drops_the_interrupt(tmp_path, command):
    (tmp_path / "sitecustomize.py").write_text(SWALLOWING_SITECUSTOMIZE)
    environment = {name: value for name, value in os.environ.items() if not name.startswith("GPUMEM_")}
    completed = subprocess.run([sys.executable, *command], env={**environment, "PYTHONPATH": str(tmp_path)},
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == -signal.SIGINT  # as a shell reports it: status 130
    assert completed.stderr == "" and completed.stdout == ""


def test_a_ctrl_c_while_another_program_imports_gpumem_goes_on_as_it_came(monkeypatch):
    from gpumem import _invocation

    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(KeyboardInterrupt), _invocation.interrupt_exits_quietly():
        raise KeyboardInterrupt
