"""A limit as Python code gives it (a spec string, a byte count, a fraction or None), in bytes."""
from __future__ import annotations

import decimal
import math
import numbers
from typing import Optional, Union

from gpumem import _C, _devices

Limit = Union[str, int, float, None]


def spec_of(limit: Limit) -> str:
    """The limit as spec text: ints are byte counts, floats fractions of the device, None "none"."""
    if limit is None:
        return "none"
    if isinstance(limit, str):
        return limit
    if isinstance(limit, bool):
        raise TypeError(f"gpumem: limit {limit!r} is a bool. Accepted forms: {_C.limit_forms}, or None")
    if isinstance(limit, numbers.Integral):
        return str(int(limit))
    if isinstance(limit, numbers.Real):
        return _fraction_text(float(limit))
    raise TypeError(
        f"gpumem: limit {limit!r} ({type(limit).__name__}) is not a spec string, an int byte count, "
        f"a float fraction or None. Accepted forms: {_C.limit_forms}"
    )


def resolve(spec: str, devices: list[int]) -> dict[int, Optional[int]]:
    """Bytes for `spec` on each device (None for no limit); raises ValueError before anything changes."""
    return {device: _C.parse_limit(spec, _devices.total(device)) for device in devices}


def _fraction_text(value: float) -> str:
    if not math.isfinite(value):
        raise ValueError(f"gpumem: limit {value!r} is not a number of bytes. Accepted forms: {_C.limit_forms}")
    # The shortest text that reads back as `value`, written out without an exponent ("1e-05" would
    # not parse): the grammar's fraction form.
    return format(decimal.Decimal(repr(value)), "f")
