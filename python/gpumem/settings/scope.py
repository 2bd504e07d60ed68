"""Limit scopes: what a device's limit bounds, as Python names them.

    "allocator"  the memory gpumem reserves for PyTorch (the default): torch.cuda.memory_reserved()
    "process"    everything the driver counts for the process on the device, as nvidia-smi shows it:
                 gpumem's reserved memory plus the CUDA context, library workspaces, NCCL's buffers

See docs/usage.md, "A limit on the whole process", for how the memory outside gpumem is measured.
"""
from __future__ import annotations

from gpumem.settings import words

ALLOCATOR, PROCESS = "allocator", "process"
FORMS = words.forms((ALLOCATOR, PROCESS))


def scope(name: str) -> str:
    """"allocator" or "process" (any case, blanks around ignored).

    Anything else raises, naming the value and the accepted forms: ValueError for a string,
    TypeError for another type.
    """
    return words.one_of(name, (ALLOCATOR, PROCESS), "limit scope")
