"""Views of torch.cuda.mem_get_info under gpumem, as Python names them (gpumem._torch_hooks shows them).

    "capped"  total = the limit, free = what gpumem could still reserve under it (the default)
    "device"  the device's own figures, as without gpumem
"""
from __future__ import annotations

from gpumem.settings import words

CAPPED, DEVICE = "capped", "device"
FORMS = words.forms((CAPPED, DEVICE))


def view(name: object) -> str:
    """CAPPED or DEVICE for a view's name (any case, blanks around); raises naming the value."""
    return words.one_of(name, (CAPPED, DEVICE), "mem_get_info view")
