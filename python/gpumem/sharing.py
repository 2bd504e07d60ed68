"""Sharing one GPU with other gpumem processes (docs/usage.md, "Sharing a GPU"; the design is in
docs/design.md): caches given back on request, a guaranteed floor, lending between floor and cap.

    GPUMEM_SHARE  "on": join the GPU's table at the first CUDA use, so that others may ask this
                  process for its free cache and it may ask them ("off", the default: alone)
    GPUMEM_FLOOR  a floor for every device ("20GB") or per device ("0:20GB,1:8GB"), in the limit
                  grammar, or "none"; implies GPUMEM_SHARE=on

The table lives in the run directory of `gpumem top` (GPUMEM_RUN_DIR, else /tmp/gpumem-<uid>),
one file per GPU UUID and user, so CUDA_VISIBLE_DEVICES does not matter and another user's
processes are never asked.
"""
from __future__ import annotations

import atexit
import os
import re
import warnings
from typing import Mapping, Optional

from gpumem import _C, _limits, _sizes

SHARE_VARIABLE = "GPUMEM_SHARE"
FLOOR_VARIABLE = "GPUMEM_FLOOR"
SHARE_FORMS = '"on" or "off"'
NO_FLOOR = ("none", "0")
_UUID = re.compile(r"^[0-9A-Za-z-]{1,64}$")
_left = False


def floor_forms() -> str:
    return f"{_C.limit_forms}; or none (no floor)"


def share_of_text(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("on", "off"):
        raise ValueError(text)
    return value == "on"


def floor_assignments(text: str) -> list[tuple[Optional[int], str]]:
    """GPUMEM_FLOOR's (device or None, spec) pairs, their syntax checked; ValueError naming the
    text and the accepted forms."""
    try:
        pairs = _C.parse_limit_assignments(text)
        for _, spec in pairs:
            if spec.strip().lower() not in NO_FLOOR:
                _limits.check_syntax(spec)
    except _C.LimitSpecError as error:
        # The reason alone: the forms that follow are GPUMEM_FLOOR's, the limit's among them.
        raise ValueError(f"gpumem: bad {FLOOR_VARIABLE} {text!r}: {error.reason}. "
                         f"Accepted forms: {floor_forms()}") from None
    return pairs


def floor_bytes(spec: str, total: int, limit: int) -> int:
    """A floor spec in bytes on a device of `total` bytes under a hard cap of `limit`; ValueError
    naming the spec if it is above the cap."""
    if isinstance(spec, str) and spec.strip().lower() in NO_FLOOR:
        return 0
    nbytes = _limits.parse(_limits.spec_of(spec), total)
    nbytes = total if nbytes is None else nbytes
    if nbytes > limit:
        raise ValueError(f"gpumem: floor {spec!r} ({_sizes.format_bytes(nbytes)}) is above the hard cap of "
                         f"{_sizes.format_bytes(limit)}: a floor is at most the limit. Accepted forms: {floor_forms()}")
    return nbytes


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
    """Joins the table of device `index`'s GPU (once); RuntimeError saying why it cannot."""
    from gpumem import _env, publish
    where = _env.run_dir() if run_dir is None else run_dir
    publish.prepare(where)
    _C.share_join(index, table_path(where.path, gpu_uuid(index)))
    _leave_at_exit()


def set_floor(index: int, nbytes: int) -> int:
    """Sets the floor on a device that shares; warns at once if the device cannot give all of it
    now. Returns the shortfall in bytes."""
    short = _C.share_set_floor(index, nbytes)
    if short:
        warnings.warn(
            f"gpumem: the floor of {_sizes.format_bytes(nbytes)} on cuda:{index} is short by {_sizes.format_bytes(short)} for now: "
            "other processes' live tensors hold that memory. Their caches were asked for; the rest is honoured as "
            "they free memory (the others cannot grow into it).", RuntimeWarning, stacklevel=3)
    return short


def status(index: int) -> Optional[dict]:
    """This process's sharing figures on a device, None where it does not share: floor, ceiling
    (what the others' floors leave it; None: no limit from them), borrowed (reserved above the
    floor), floor_short, asks_made, asks_served (the others' requests it answered), given_back
    (bytes it released on request) and others (pid, floor, reserved, in_use of each member)."""
    return _C.share_status(index)


def start_for_environment(environ: Mapping[str, str] = os.environ) -> None:
    """At torch's CUDA start: joins every visible device's table where GPUMEM_SHARE=on or
    GPUMEM_FLOOR asks, and sets the floors. Reports and goes on alone where it cannot (it must not
    raise: torch would make that the program's first CUDA call's error)."""
    import sys
    try:
        share = environ.get(SHARE_VARIABLE)
        floors = environ.get(FLOOR_VARIABLE)
        on = share_of_text(share) if share is not None else False
        if not on and floors is None:
            return
        pairs = floor_assignments(floors) if floors is not None else []
        for index in range(_C.device_count()):
            spec = next((s for d, s in pairs if d in (None, -1, index)), None)
            join(index)
            if spec is not None:
                set_floor(index, floor_bytes(spec, _C.device_total(index), _C.get_limit(index)))
    except Exception as error:  # noqa: BLE001 - reported, and the process goes on alone
        sys.stderr.write(f"gpumem: not sharing the GPU: {error}\n")


def _leave_at_exit() -> None:
    global _left
    if not _left:
        _left = True
        atexit.register(_C.share_leave_all)
