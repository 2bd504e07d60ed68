"""Byte counts as gpumem's messages write them: "512 bytes", "1.50 GiB", "16.00 TiB".

The compiled layer's format_bytes (csrc/core/errors.cpp) writes every count it can take, those
below 2^64; Python's figures can be larger (sizes a snapshot adds up, say), and for those the
same form goes on in TiB, worked out here with integers. A count past any meaning (more than
2^128 TiB) is written as a power of two, without making its digits.
"""
from __future__ import annotations

import gpumem._C as _C
from gpumem.settings.echo import shown

_TIB = 1 << 40
_DIGITS_SHOWN_BITS = 128  # past this many bits of TiB, a count is written as a power of two


def format_bytes(count: int) -> str:
    """`count`, a non-negative int, as gpumem's messages write a size; TypeError or ValueError
    naming anything else."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"gpumem: a byte count {shown(count)} ({type(count).__name__}) is not an int")
    if count < 0:
        raise ValueError(f"gpumem: a byte count {shown(count)} is negative")
    if count < 1 << 64:
        return _C.format_bytes(count)
    hundredths = (count * 100 + _TIB // 2) // _TIB  # rounded half up, as the compiled layer's %.2f nearly does
    if hundredths.bit_length() > _DIGITS_SHOWN_BITS:
        return f"about 2^{count.bit_length() - 1} bytes"
    whole, part = divmod(hundredths, 100)
    return f"{whole}.{part:02d} TiB"
