"""A limit as Python code gives it (a spec string, a byte count, a fraction or None), in bytes."""
from __future__ import annotations

import decimal
import math
import numbers
from typing import Optional, Union

import gpumem._C as _C
from gpumem.settings import devices as _devices
from gpumem.settings.echo import bounded, shown
from gpumem.settings.words import not_utf8

Limit = Union[str, int, float, None]
ANY_TOTAL = 1 << 62  # checks a spec's syntax: every real device is smaller
_QUOTE = '"'  # the grammar's messages quote a limit so


def spec_of(limit: Limit) -> str:
    """The limit as spec text: ints are byte counts, floats fractions of the device, None "none"."""
    if limit is None:
        return "none"
    if isinstance(limit, str):
        return limit
    if isinstance(limit, bool):
        raise TypeError(f"gpumem: limit {limit} is a bool. Accepted forms: {_C.limit_forms}, or None")
    if isinstance(limit, numbers.Integral):
        return _count_text(int(limit))
    if isinstance(limit, numbers.Real):
        return _fraction_text(float(limit))
    raise TypeError(
        f"gpumem: limit {shown(limit)} ({type(limit).__name__}) is not a spec string, an int byte count, "
        f"a float fraction or None. Accepted forms: {_C.limit_forms}"
    )


def check_syntax(spec: str) -> None:
    """Raises ValueError naming `spec` and the accepted forms if it is not a limit on any device;
    asks no device, so a typo is reported as one on a machine without a GPU too."""
    parse(spec, ANY_TOTAL)


def parse(spec: str, total: int) -> Optional[int]:
    """Bytes for `spec` on a device of `total` bytes (None for no limit), as the compiled grammar
    reads it; what it refuses raises _C.LimitSpecError (a ValueError), its message showing `spec`
    as gpumem's Python messages show the user's text."""
    problem = not_utf8(spec)
    if problem is not None:
        raise refused(spec, problem, _C.limit_forms)
    try:
        return _C.parse_limit(spec, total)
    except _C.LimitSpecError as error:
        raise refused(spec, error.reason, error.forms) from None


def refused(spec: str, why: str, forms: str) -> ValueError:
    """The _C.LimitSpecError for limit `spec`, with the parts the compiled layer's errors carry."""
    error = _C.LimitSpecError(f"gpumem: bad limit {shown(spec, quote=_QUOTE)}: {bounded(why)}. Accepted forms: {forms}")
    error.setting, error.spec, error.reason, error.forms = "limit", spec, bounded(why), forms
    return error


def reason(error: ValueError) -> str:
    """Why a limit was refused and the forms accepted, for a message that names the limit itself:
    the parts of the _C.LimitSpecError, read as fields (the compiled layer's message is never
    parsed; core/errors.h)."""
    return f"{error.reason}. Accepted forms: {error.forms}" if error.forms else error.reason


def resolve(spec: str, devices: list[int]) -> dict[int, Optional[int]]:
    """Bytes for `spec` on each device (None for no limit); raises ValueError before anything changes."""
    return {device: parse(spec, _devices.total(device)) for device in devices}


def _count_text(count: int) -> str:
    # Python refuses to write an int of more than 4300 digits as text; no device is near 2**64 bytes.
    if abs(count) >= 1 << 64:
        raise ValueError(f"gpumem: limit {shown(count)} is out of range: a byte count is from 1 to the "
                         f"device's total. Accepted forms: {_C.limit_forms}")
    return str(count)


def _fraction_text(value: float) -> str:
    if not math.isfinite(value):
        raise ValueError(f"gpumem: limit {value} is not a number of bytes. Accepted forms: {_C.limit_forms}")
    # The shortest text that reads back as `value`, written out without an exponent ("1e-05" would
    # not parse): the grammar's fraction form.
    return format(decimal.Decimal(repr(value)), "f")
