"""Floors and the choice to share: GPUMEM_SHARE, GPUMEM_FLOOR and set_limit's floor, read and
checked (gpumem.sharing shares). A floor is in the limit's grammar, or "none" or "0" for none; on a
device it is at most the device and the hard cap.
"""
from __future__ import annotations

from typing import Optional, Sequence

import gpumem._C as _C
from gpumem.settings import limits as _limits, sizes
from gpumem.settings.echo import bounded, shown

SHARE_VARIABLE = "GPUMEM_SHARE"
FLOOR_VARIABLE = "GPUMEM_FLOOR"
SHARE_FORMS = '"on" or "off"'
NO_FLOOR = ("none", "0")
_QUOTE = '"'  # as the limit grammar's messages quote a value


class FloorError(ValueError):
    """A floor gpumem refuses; `reason` says why without naming the floor or its setting."""

    def __init__(self, spec: str, reason: str):
        self.spec, self.reason = spec, bounded(reason)
        super().__init__(f"gpumem: bad floor {shown(spec, quote=_QUOTE)}: {self.reason}. Accepted forms: {floor_forms()}")


class FloorSettingError(ValueError):
    """GPUMEM_FLOOR=`text` that cannot be applied on device `device` (None: on none, its syntax);
    `reason` says why without naming the variable or its value."""

    def __init__(self, text: str, device: Optional[int], reason: str):
        self.text, self.device, self.reason = text, device, bounded(reason)
        on = "" if device is None else f" on device {device}"
        super().__init__(f"gpumem: bad {FLOOR_VARIABLE} {shown(text, quote=_QUOTE)}{on}: {self.reason}. Accepted "
                         f"forms: {floor_forms()}. No CUDA memory is handed out until it is fixed: fix "
                         f"{FLOOR_VARIABLE} or unset it, and start the program again.")


def floor_forms() -> str:
    return f'{_C.limit_forms}; "none" or "0" is no floor'


def share_of_text(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("on", "off"):
        raise ValueError(text)
    return value == "on"


def floor_assignments(text: str) -> list[tuple[int, str]]:
    """GPUMEM_FLOOR's (device, spec) pairs, -1 for every device, their syntax checked; FloorError
    (a ValueError) naming the text and the accepted forms."""
    try:
        pairs = _C.parse_limit_assignments(text)
        for _, spec in pairs:
            if not _is_no_floor(spec):
                _limits.check_syntax(spec)
    except _C.LimitSpecError as error:
        raise FloorError(text, error.reason) from None
    return pairs


def floor_bytes(spec: str, total: int, limit: int) -> int:
    """A floor spec in bytes on a device of `total` bytes under a hard cap of `limit`; FloorError
    (a ValueError) naming the spec if it is above the device or the cap."""
    if _is_no_floor(spec):
        return 0
    try:
        nbytes = _limits.parse(_limits.spec_of(spec), total)
    except _C.LimitSpecError as error:
        raise FloorError(spec, error.reason) from None
    if nbytes > limit:
        raise FloorError(spec, f"it comes to {sizes.format_bytes(nbytes)}, above the hard cap of "
                               f"{sizes.format_bytes(limit)}: a floor is at most the limit")
    return nbytes


def resolve_floors(text: str, totals: Sequence[int], limits: Sequence[int]) -> list[Optional[int]]:
    """GPUMEM_FLOOR=`text` on devices of these totals under these hard caps: each device's floor
    in bytes, None where it names none. What cannot be applied, on any device, raises
    FloorSettingError (a ValueError) naming GPUMEM_FLOOR, its value, the device and the accepted
    forms. The one check of GPUMEM_FLOOR on the devices: CUDA init and `gpumem info` share it."""
    try:
        pairs = floor_assignments(text)
    except FloorError as error:
        raise FloorSettingError(text, None, error.reason) from None
    floors: list[Optional[int]] = [None] * len(totals)
    for device, spec in pairs:
        if device >= len(totals):
            seen = f"devices 0..{len(totals) - 1}" if totals else "no CUDA device"
            raise FloorSettingError(text, device, f"there is no CUDA device {device}; this process sees {seen} "
                                                  "(CUDA_VISIBLE_DEVICES applies)")
        for index in range(len(totals)) if device == -1 else [device]:
            try:
                floors[index] = floor_bytes(spec, totals[index], limits[index])
            except FloorError as error:
                raise FloorSettingError(text, index, error.reason) from None
    return floors


def _is_no_floor(spec: object) -> bool:
    return isinstance(spec, str) and spec.strip().lower() in NO_FLOOR
