"""GPUMEM_LIMIT, GPUMEM_SHARE or GPUMEM_FLOOR without code changes: gpumem installs itself when
torch is imported.

The top-level module _gpumem_autoload (loaded at start-up by gpumem-autoload.pth, only when one of
ARMING, the three, is set) calls `install()` right after torch's own import has finished, before
the program can allocate CUDA memory. `state` says what it did, for tests and for people debugging:

    "not run"                      torch has not been imported, none of the three was set, or only
                                   GPUMEM_SHARE=off (which asks for nothing)
    "installed"                    gpumem is the CUDA allocator; GPUMEM_LIMIT's limits apply when
                                   the devices are first used, and GPUMEM_SHARE=on or GPUMEM_FLOOR
                                   joins the GPUs' tables then (gpumem.sharing); no cap unless
                                   GPUMEM_LIMIT sets one
    "skipped: the gpumem command"  see _is_the_gpumem_command

A GPUMEM_LIMIT whose syntax is bad stops the program with exit status 2 and one line on stderr,
`gpumem: bad GPUMEM_LIMIT "4XB": ...`, rather than let it run without the cap. So does a bad
GPUMEM_SHARE (`gpumem: bad GPUMEM_SHARE "maybe": give "on" or "off". ...`), a GPUMEM_FLOOR whose
syntax is bad (`gpumem: bad GPUMEM_FLOOR "20XB": ...`, whether or not another variable installs
gpumem: the program asked to share), and a bad GPUMEM_SEGMENTS. GPUMEM_SEGMENTS alone does not
install gpumem: it says which segments gpumem uses once something installs it. A bad
GPUMEM_WARN_AT, GPUMEM_METRICS_PORT, GPUMEM_METRICS_ADDR, GPUMEM_PUBLISH or GPUMEM_RUN_DIR stops
the program the same way (see docs/monitoring.md).

Installing touches no CUDA, as `import torch` does not: CUDA_VISIBLE_DEVICES set after the import
still applies, and a child forked before CUDA is used can use it. What GPUMEM_LIMIT means on the
devices (a percentage, a device number, a size above a device's memory) is worked out at torch's
CUDA init; one that does not fit makes that init, and every CUDA allocation after it, raise
`gpumem: bad GPUMEM_LIMIT "...": ...` (no memory is handed out without the cap). So does a
GPUMEM_FLOOR that does not fit (`gpumem: bad GPUMEM_FLOOR "...": ...`), and a GPU table that
cannot be joined (gpumem.sharing.start_for_environment). On a machine without a CUDA device
nothing is ever asked of one, and nothing is printed.

Note [when a bad GPUMEM_LIMIT is caught]
  At torch's import, not at interpreter start-up. The limit grammar is gpumem._C's, in C++, and
  loading _C needs torch; a second grammar in Python, to check at start-up, could drift from it.
  Waiting costs no safety: a program allocates CUDA memory through torch only after importing
  it. And a GPUMEM_LIMIT left in a shell does not break Python programs that never use torch
  (pip, say). The syntax is checked before anything else, so a typo stops the program on a
  machine without a GPU too; what depends on the devices (a limit above a device's memory, a
  device that does not exist) is checked at torch's CUDA init, the first moment the devices may
  be asked without changing what the program sees. GPUMEM_FLOOR, in the same grammar, is caught
  at the same two moments for the same reasons.
"""
from __future__ import annotations

import os
import sys

from gpumem import _invocation, api
from gpumem.settings import environment, floors
from gpumem.settings.echo import bounded, shown

EXIT_BAD_LIMIT = 2
# The variables that install gpumem; gpumem-autoload.pth arms the hook on the same three.
ARMING = (environment.VARIABLE, floors.SHARE_VARIABLE, floors.FLOOR_VARIABLE)

state = "not run"


def install() -> None:
    """Installs gpumem with GPUMEM_LIMIT's limits, GPUMEM_SEGMENTS's segment kind and the sharing
    GPUMEM_SHARE or GPUMEM_FLOOR asks for; exits with status 2 if they cannot be applied."""
    global state
    if not any(variable in os.environ for variable in ARMING):
        return
    if _is_the_gpumem_command():
        state = "skipped: the gpumem command"
        return
    try:
        if environment.limit_text() is None and not environment.sharing_asked():
            return  # GPUMEM_SHARE=off alone: nothing to install
        for _, read in environment.SETTINGS:
            read()
    except environment.SettingError as error:
        _stop_for(error)
    try:
        api.enable()
    except Exception as error:  # noqa: BLE001: whatever it is, the program must not run uncapped
        reason = bounded(str(error).removeprefix("gpumem: "))
        asked = " ".join(f"{variable}={shown(os.environ[variable])}" for variable in ARMING if variable in os.environ)
        _stop(f"gpumem: {asked} is set but gpumem could not be installed ({reason}); the program stops rather "
              "than run without what it asked for.")
    state = "installed"


def _is_the_gpumem_command() -> bool:
    """The gpumem command reads GPUMEM_LIMIT itself (`gpumem info` reports a bad one, `gpumem run`
    hands it to the program it starts) and allocates no CUDA memory, so it is left alone. It is
    known by what it runs, not by its name: a user's own script called gpumem gets the hook."""
    return _invocation.is_the_console_script() or _invocation.is_python_m_gpumem()


def _stop_for(error: environment.SettingError) -> None:
    instead = _INSTEAD.get(error.variable, "run with settings it did not ask for")
    value = shown(error.text, quote='"')  # quoted as the compiled layer quotes it at CUDA init
    _stop(f"gpumem: bad {error.variable} {value}: {error.reason}. The program stops rather than "
          f"{instead}: fix {error.variable} or unset it.")


_INSTEAD = {environment.VARIABLE: "run without the cap", floors.SHARE_VARIABLE: "guess whether to share the GPU",
            floors.FLOOR_VARIABLE: "run without the floor it asked for"}


def _stop(line: str) -> None:
    sys.stderr.write(line + "\n")
    raise SystemExit(EXIT_BAD_LIMIT)
