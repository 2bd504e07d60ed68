"""Segment kinds: where a device's new memory comes from, as Python names them.

    "growable"  segments that reserve a virtual address range and map physical pages into it as they
                grow (CUDA virtual memory management); the default where the driver supports it
    "plain"     one cudaMalloc per segment

The allocator takes a bool (growable or not); the names live here, once.
"""
from __future__ import annotations

from gpumem.settings import words

GROWABLE, PLAIN = "growable", "plain"
FORMS = words.forms((GROWABLE, PLAIN))


def growable(kind: str) -> bool:
    """True for "growable", False for "plain" (any case, blanks around ignored).

    Anything else raises, naming the value and the accepted forms: ValueError for a string,
    TypeError for another type.
    """
    return words.one_of(kind, (GROWABLE, PLAIN), "segment kind") == GROWABLE


def kind(growable_on: bool) -> str:
    return GROWABLE if growable_on else PLAIN
