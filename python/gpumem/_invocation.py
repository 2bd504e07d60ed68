"""Whether this process is `python -m gpumem`, and its Ctrl-C while it starts. Imports neither
torch nor anything of gpumem's: gpumem's __init__ uses it before it imports torch.

`python -m gpumem` imports the package, and with it torch (a second or more), before it runs
gpumem/__main__.py, whose cli.main turns a Ctrl-C into exit status 130 from then on. A Ctrl-C while
the package imports would end in a KeyboardInterrupt traceback: interrupt_exits_quietly, around the
package's imports, makes it exit 130 without one, as the console script's start-up does
(_gpumem_command). In any other program that imports gpumem the KeyboardInterrupt goes on as it
came: the program's to handle.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

EXIT_INTERRUPTED = 130


def is_python_m_gpumem() -> bool:
    # runpy imports the package, and with it torch, while argv[0] is "-m".
    argv = list(getattr(sys, "orig_argv", []))
    return sys.argv[:1] == ["-m"] and "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["gpumem"]


@contextlib.contextmanager
def interrupt_exits_quietly() -> Iterator[None]:
    """A KeyboardInterrupt inside becomes SystemExit(130) in `python -m gpumem`."""
    try:
        yield
    except KeyboardInterrupt:
        if is_python_m_gpumem():
            raise SystemExit(EXIT_INTERRUPTED) from None
        raise
