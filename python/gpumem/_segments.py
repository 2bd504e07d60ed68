"""Segment kinds: where a device's new memory comes from, as Python names them.

    "growable"  segments that reserve a virtual address range and map physical pages into it as they
                grow (CUDA virtual memory management); the default where the driver supports it
    "plain"     one cudaMalloc per segment

The allocator takes a bool (growable or not); the names live here, once.
"""
from __future__ import annotations

GROWABLE, PLAIN = "growable", "plain"
FORMS = f'"{GROWABLE}" or "{PLAIN}"'


def growable(kind: str) -> bool:
    """True for "growable", False for "plain" (any case, blanks around ignored).

    Anything else raises, naming the value and the accepted forms: ValueError for a string,
    TypeError for another type.
    """
    if not isinstance(kind, str):
        raise TypeError(f"gpumem: segment kind {kind!r} ({type(kind).__name__}) is not a string; "
                        f"give {FORMS}")
    word = kind.strip().lower()
    if word not in (GROWABLE, PLAIN):
        raise ValueError(f"gpumem: bad segment kind {kind!r}: give {FORMS}")
    return word == GROWABLE


def kind(growable_on: bool) -> str:
    return GROWABLE if growable_on else PLAIN
