"""GPUMEM_LIMIT: the limits that apply when gpumem is installed, "4GB" or per device "0:4GB,1:8GB"."""
from __future__ import annotations

import os
from typing import Mapping, Optional

from gpumem import _C, _devices, _limits

VARIABLE = "GPUMEM_LIMIT"


def limits(environ: Mapping[str, str] = os.environ) -> dict[int, Optional[int]]:
    """Bytes per device from GPUMEM_LIMIT ({} when it is unset); a bad value raises ValueError."""
    text = environ.get(VARIABLE)
    if text is None:
        return {}
    try:
        return _assigned(text)
    except ValueError as error:
        # A typo must stop the run, never leave it uncapped.
        raise ValueError(f"gpumem: {VARIABLE}={text!r} cannot be applied: {error}") from None


def _assigned(text: str) -> dict[int, Optional[int]]:
    result: dict[int, Optional[int]] = {}
    for device, spec in _C.parse_limit_assignments(text):
        devices = _devices.every() if device == -1 else [_devices.index(device)]
        result.update(_limits.resolve(spec, devices))
    return result
