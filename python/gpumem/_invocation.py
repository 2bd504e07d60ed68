"""Whether this process is the gpumem command, and its Ctrl-C while it starts. Imports neither
torch nor anything of gpumem's: gpumem's __init__ uses it before it imports torch.

`python -m gpumem` imports the package, and with it torch (a second or more), before it runs
gpumem/__main__.py, whose cli.main turns a Ctrl-C into exit status 130 from then on. A Ctrl-C while
the package imports would end in a KeyboardInterrupt traceback: interrupt_exits_quietly, around the
package's imports, makes it exit 130 without one, as the console script's start-up does
(_gpumem_command). In any other program that imports gpumem the KeyboardInterrupt goes on as it
came: the program's to handle.

A KeyboardInterrupt alone is not enough: torch's compiled module imports numpy while it loads and
drops whatever that import raises, so a KeyboardInterrupt there is lost (the command runs on) or,
numpy left half set up, ends in numpy's RuntimeError traceback. So in the gpumem command, while
the package imports, Ctrl-C has its default action: the process ends at once, with no output, and
the shell reports status 130 as for a KeyboardInterrupt.
"""
from __future__ import annotations

import contextlib
import signal
import sys
from typing import Iterator

EXIT_INTERRUPTED = 130


def is_python_m_gpumem() -> bool:
    # runpy imports the package, and with it torch, while argv[0] is "-m".
    argv = list(getattr(sys, "orig_argv", []))
    return sys.argv[:1] == ["-m"] and "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["gpumem"]


def is_the_console_script() -> bool:
    # The console script starts in _gpumem_command, which says so before it imports gpumem.
    command = sys.modules.get("_gpumem_command")
    return command is not None and getattr(command, "running", False) is True


@contextlib.contextmanager
def interrupt_exits_quietly() -> Iterator[None]:
    """A KeyboardInterrupt inside becomes SystemExit(130) in `python -m gpumem`; a Ctrl-C inside
    ends the gpumem command at once, whatever an import does with its KeyboardInterrupt."""
    try:
        with _ctrl_c_ends_the_process(is_python_m_gpumem() or is_the_console_script()):
            yield
    except KeyboardInterrupt:
        if is_python_m_gpumem():
            raise SystemExit(EXIT_INTERRUPTED) from None
        raise


@contextlib.contextmanager
def _ctrl_c_ends_the_process(wanted: bool) -> Iterator[None]:
    # Only over Python's own handler: an ignored SIGINT (a background job) stays ignored.
    if not wanted or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
