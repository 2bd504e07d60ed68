"""The environment's settings, handed to gpumem when it is installed.

    GPUMEM_LIMIT     the limits: "4GB" for every device, or per device "0:4GB,1:8GB"
    GPUMEM_SEGMENTS  the segment kind on every device: "growable" or "plain"

Installing touches no CUDA: the syntax is checked then (`limit_text`), and what depends on the
devices (a percentage, a device number, a size above a device's memory) when the devices are first
used, by the compiled layer (see `limits` for the same check on demand).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from gpumem import _C, _devices, _limits, _segments

VARIABLE = "GPUMEM_LIMIT"
SEGMENTS_VARIABLE = "GPUMEM_SEGMENTS"
_ANY_TOTAL = 1 << 62  # checks a spec's syntax: every real device is smaller


def limit_text(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """GPUMEM_LIMIT's value (None when unset), its syntax checked without asking any device; a bad
    one raises ValueError naming the variable, its value and the accepted forms."""
    text = environ.get(VARIABLE)
    if text is None:
        return None
    try:
        for _, spec in _C.parse_limit_assignments(text):
            _C.parse_limit(spec, _ANY_TOTAL)
    except ValueError as error:
        raise ValueError(f"gpumem: {VARIABLE}={text!r} cannot be applied: {error}") from None
    return text


def limits(environ: Mapping[str, str] = os.environ) -> dict[int, Optional[int]]:
    """Bytes per device from GPUMEM_LIMIT ({} when it is unset), asking the devices; a bad value
    raises ValueError."""
    text = environ.get(VARIABLE)
    if text is None:
        return {}
    try:
        return _assigned(text)
    except ValueError as error:
        # A typo must stop the run, never leave it uncapped.
        raise ValueError(f"gpumem: {VARIABLE}={text!r} cannot be applied: {error}") from None


def segments(environ: Mapping[str, str] = os.environ) -> Optional[bool]:
    """Whether GPUMEM_SEGMENTS asks for growable segments; None when it is unset. A bad value
    raises ValueError naming the variable, its value and the accepted forms."""
    text = environ.get(SEGMENTS_VARIABLE)
    if text is None:
        return None
    try:
        return _segments.growable(text)
    except ValueError:
        raise ValueError(f"gpumem: {SEGMENTS_VARIABLE}={text!r} cannot be applied: "
                         f"give {_segments.FORMS}") from None


def _assigned(text: str) -> dict[int, Optional[int]]:
    result: dict[int, Optional[int]] = {}
    for device, spec in _C.parse_limit_assignments(text):
        devices = _devices.every() if device == -1 else [_devices.index(device)]
        result.update(_limits.resolve(spec, devices))
    return result
