"""The least chunk of growable memory: how coarsely the large pool's growable segments map memory.

A chunk is one physical allocation: memory goes back to the device only as whole chunks, and a
process that receives a tensor opens each chunk it lies on with a driver call of its own. Pages
(the default, "0") let every free page go back, which is what a tight cap needs; a few MB makes
tensors sent to other processes open as fast as PyTorch's own (docs/usage.md, "CUDA tensors
between processes"). Requests of the small pool (1 MB and less) are mapped in pages whatever it is.

    "16MB", "16 MiB", "2M", "0"   a size with a binary unit, or a byte count; at most 256 MB
"""
from __future__ import annotations

import re

import gpumem._C as _C
from gpumem.settings.echo import shown

LARGEST = _C.MAX_CHUNK  # the core's bound (core/device_allocator.h)
FORMS = ('a size with a binary unit ("16MB", "16 MiB", "2M"; 1 MB = 1048576 bytes) or a byte count '
         f'("16777216"), from 0 (pages, the default) to {LARGEST >> 20} MB')
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20}
_SIZE = re.compile(r"(\d{1,12})\s*([a-z]*)")


def chunk_bytes(value: object) -> int:
    """The bytes `value` names: an int, or a string of FORMS (any case, blanks around ignored).

    Anything else raises, naming the value and the accepted forms: ValueError for a bad string or
    size, TypeError for another type.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"gpumem: a chunk {shown(value)} ({type(value).__name__}) is neither a size nor a byte "
                        f"count; give {FORMS}")
    if isinstance(value, int):
        count = value
    else:
        match = _SIZE.fullmatch(value.strip().lower())
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(f"gpumem: bad chunk {shown(value)}: give {FORMS}")
        count = int(match.group(1)) * _UNITS[match.group(2)]
    if not 0 <= count <= LARGEST:
        raise ValueError(f"gpumem: a chunk of {shown(value)} is outside 0 to {LARGEST >> 20} MB: give {FORMS}")
    return count
