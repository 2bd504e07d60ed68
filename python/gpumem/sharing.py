"""Sharing one GPU with other gpumem processes (docs/usage.md, "Sharing a GPU"; the design is in
docs/design.md): caches given back on request, a guaranteed floor, lending between floor and cap.

    GPUMEM_SHARE  "on": join the GPU's table at the first CUDA use, so that others may ask this
                  process for its free cache and it may ask them ("off", the default: alone)
    GPUMEM_FLOOR  a floor for every device ("20GB") or per device ("0:20GB,1:8GB"), in the limit
                  grammar, or "none"; implies GPUMEM_SHARE=on

Either one installs gpumem at torch's import, as GPUMEM_LIMIT does (gpumem._autoload), and their
syntax is checked then. What depends on the devices is checked at torch's CUDA init
(start_for_environment), every device before anything is joined: a floor for a device that does
not exist, above the device's memory or above the hard cap, and a table that cannot be joined,
make that init, and every CUDA call after it, raise, as a GPUMEM_LIMIT that does not fit does. A
program that asked to share never runs alone, nor without the floor it asked for.

The table lives in the run directory of `gpumem top` (GPUMEM_RUN_DIR, else /tmp/gpumem-<uid>),
one file per GPU UUID and user, so CUDA_VISIBLE_DEVICES does not matter and another user's
processes are never asked. The directory must be this user's own and writable by nobody else
(published.run_dir_problem, SHARE).

A process leaves its tables at exit (atexit); a child it forks is no member, and leaves nothing
(_leave_at_exit).
"""
from __future__ import annotations

import atexit
import os
import re
import warnings
from typing import Mapping, Optional

import gpumem._C as _C
from gpumem.monitoring import publish, published
from gpumem.settings import environment, sizes
from gpumem.settings.echo import bounded, shown, shown_path
from gpumem.settings.floors import FLOOR_VARIABLE, SHARE_VARIABLE, resolve_floors

_UUID = re.compile(r"^[0-9A-Za-z-]{1,64}$")
_joined_in: Optional[int] = None  # the pid that joined a table: the only one that leaves at exit


def table_path(run_dir_path: str, uuid: str) -> str:
    """The table of one GPU and user, under the run directory."""
    if not _UUID.match(uuid):
        raise RuntimeError(f"gpumem: sharing: the GPU's UUID {uuid[:80]!r} is not one gpumem can name a file by")
    return os.path.join(run_dir_path, f"share-{uuid}-uid{os.geteuid()}.table")


def gpu_uuid(index: int) -> str:
    import torch
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def join(index: int, run_dir=None) -> None:
    """Joins the table of device `index`'s GPU (once); RuntimeError saying why it cannot, the run
    directory's trust checked here (published.run_dir_problem), not by the compiled layer."""
    where = environment.run_dir() if run_dir is None else run_dir
    try:
        publish.prepare(where, published.SHARE)
    except OSError as error:  # made by prepare: the path and the reason; else the system's
        reason = str(error) if error.strerror is None else f"{shown_path(where.path)}: {error.strerror}"
        raise RuntimeError(f"gpumem: sharing: the run directory cannot hold the GPU's table: {bounded(reason)}") from None
    _C.share_join(index, table_path(where.path, gpu_uuid(index)))
    _leave_at_exit()


def set_floor(index: int, nbytes: int) -> int:
    """Sets the floor on a device that shares, granted from what the other processes' floors leave
    of the device (floors add up to the device at most). Warns at once where less was granted,
    naming the processes that hold the other floors, and where the others' live tensors hold part
    of it now. Returns the shortfall in bytes: what was not granted plus what is held now."""
    grant = _C.share_grant_floor(index, nbytes)
    granted, short = grant["granted"], grant["short"]
    if granted < nbytes:
        holders = ", ".join(_holder(h) for h in grant["floor_holders"]) or "none now"
        warnings.warn(
            f"gpumem: the floor of {sizes.format_bytes(nbytes)} on cuda:{index} was granted only "
            f"{sizes.format_bytes(granted)}: the other processes' floors claim the rest of the device "
            f"({holders}). Lower one of theirs, or ask for at most {sizes.format_bytes(granted)}.",
            RuntimeWarning, stacklevel=3)
    if short:
        warnings.warn(
            f"gpumem: the floor of {sizes.format_bytes(granted)} on cuda:{index} is short by {sizes.format_bytes(short)} for now: "
            "other processes' live tensors hold that memory. Their caches were asked for; the rest is honoured as "
            "they free memory (the others cannot grow into it).", RuntimeWarning, stacklevel=3)
    return (nbytes - granted) + short


def _holder(member: dict) -> str:
    where = "" if member.get("same_pid_namespace", True) else " of another pid namespace"
    return f"pid {member['pid']}{where}: {sizes.format_bytes(member['floor'])}"


def status(index: int) -> Optional[dict]:
    """This process's sharing figures on a device, None where it does not share: floor, ceiling
    (what the others' floors leave it; None: no limit from them), borrowed (reserved above the
    floor), floor_short, asks_made, asks_served (the others' requests it answered), given_back
    (bytes it released on request) and others (pid, floor, reserved, in_use of each member)."""
    return _C.share_status(index)


def start_at_cuda_init() -> None:
    """Queues start_for_environment for torch's CUDA init. Unlike the monitoring's calls
    (gpumem.monitoring.startup.when_cuda_starts) it may raise: torch.cuda._lazy_init then raises
    (DeferredCudaCallError, with this error's message), leaves CUDA uninitialized and its queued
    calls queued, and runs them all again at the next CUDA call: every one raises until the
    setting is fixed, as for a GPUMEM_LIMIT that does not fit the devices."""
    import torch
    torch.cuda._lazy_call(start_for_environment)


def start_for_environment(environ: Mapping[str, str] = os.environ) -> None:
    """At torch's CUDA init: where GPUMEM_SHARE=on or GPUMEM_FLOOR asks, checks every visible
    device's floor, then joins every device's table and sets the floors. A floor that cannot be
    applied raises FloorSettingError (a ValueError), a table that cannot be joined RuntimeError,
    each naming the setting and why, before anything is joined or having left what was (the
    program asked to share: it must not run alone)."""
    if not environment.sharing_asked(environ):
        return
    floors_text = environ.get(FLOOR_VARIABLE)
    count = _C.device_count()
    totals = [_C.device_total(index) for index in range(count)]
    limits = [_C.get_limit(index) for index in range(count)]
    floors = resolve_floors(floors_text, totals, limits) if floors_text is not None else [None] * count
    try:
        for index in range(count):
            join(index)
    except Exception as error:
        _C.share_leave_all()
        asked = f"{FLOOR_VARIABLE}={shown(floors_text)}" if floors_text is not None else f"{SHARE_VARIABLE}=on"
        raise RuntimeError(f"gpumem: {asked} asks to share the GPU, but it cannot be shared: "
                           f"{bounded(str(error).removeprefix('gpumem: '))}. No CUDA memory is handed out until "
                           f"it can: fix that, or unset {FLOOR_VARIABLE} and {SHARE_VARIABLE}, and start the "
                           "program again.") from None
    for index, nbytes in enumerate(floors):
        if nbytes is not None:
            set_floor(index, nbytes)


def _leave_at_exit() -> None:
    """Leaves every table at exit, in the process that joined only: a child made by os.fork()
    inherits the atexit list but is no member, and must not free its parent's slots (as
    publish.Publisher.stop leaves a parent's file alone)."""
    global _joined_in
    if _joined_in is None:
        atexit.register(_leave_if_joined_here)
    _joined_in = os.getpid()


def _leave_if_joined_here() -> None:
    if os.getpid() == _joined_in:
        _C.share_leave_all()
