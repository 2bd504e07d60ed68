"""What gpumem changes in torch's Python API when it is installed, so code that sizes itself from
torch sees the cap.

- `torch.cuda.mem_get_info` (also as `torch.cuda.memory.mem_get_info`): the capped view by default,
  total = the limit and free = what gpumem could still reserve without passing it (the limit less
  what is reserved, and no more than the device has free; cached memory is not free, as native
  counts it). Uncapped it is the device's own figures. `gpumem.device_mem_info` always gives
  those; `gpumem.set_mem_info_view("device")` or GPUMEM_MEM_INFO=device turns the capped view off.
  Code that took the function before gpumem was installed (`from torch.cuda import mem_get_info`
  at import, ahead of gpumem.set_limit) keeps the original.
- `torch._C._accelerator_setAllocatorSettings` (what `torch.cuda.memory._set_allocator_settings`
  calls; before torch 2.9 or so `torch._C._cuda_cudaCachingAllocator_set_allocator_settings`, which
  2.6 has alone): after torch has parsed the settings, what they name of expandable_segments and
  garbage_collection_threshold reaches gpumem's devices (see csrc/torch/startup.h).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

import gpumem._C as _C
from gpumem.settings import mem_info

_original_mem_get_info: Optional[Callable] = None
# torch's settings setters, by name on torch._C: the newer releases' and the older ones'.
SETTINGS_SETTERS = ("_accelerator_setAllocatorSettings", "_cuda_cudaCachingAllocator_set_allocator_settings")
_original_set_settings: dict[str, Callable] = {}  # each one gpumem wrapped, by name
_view = mem_info.CAPPED
# Which of torch's settings gpumem's own settings have fixed (GPUMEM_SEGMENTS, set_segments,
# set_release_threshold): torch's settings changed later leave those alone.
fixed = {"segments": False, "release_threshold": False}


def set_view(view: str) -> None:
    global _view
    _view = mem_info.view(view)


def install() -> None:
    """Puts the wrappers in place; once, when gpumem is installed (under gpumem.api's lock)."""
    global _original_mem_get_info
    if _original_mem_get_info is None:
        _original_mem_get_info = torch.cuda.memory.mem_get_info
        torch.cuda.memory.mem_get_info = _mem_get_info
        torch.cuda.mem_get_info = _mem_get_info
    for name in SETTINGS_SETTERS:
        setter = getattr(torch._C, name, None)
        if name not in _original_set_settings and setter is not None:
            _original_set_settings[name] = setter
            setattr(torch._C, name, _settings_setter(setter))


def device_mem_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device itself, as CUDA reports them, cap or no cap."""
    original = _original_mem_get_info or torch.cuda.memory.mem_get_info
    return original(device)


def _mem_get_info(device=None) -> tuple[int, int]:
    free, total = _original_mem_get_info(device)  # torch's checks, its lazy init, its device numbering
    if _view != mem_info.CAPPED or not _C.is_installed():
        return free, total
    if device is None:
        device = torch.cuda.current_device()
    index = torch.cuda._utils._get_device_index(device, optional=True)
    return tuple(_C.capped_mem_info(index, free, total))


_mem_get_info.__doc__ = (
    "torch.cuda.mem_get_info under gpumem: (free, total) of the device as a job under the cap sees it: "
    "total is the limit, free what gpumem could still reserve. gpumem.device_mem_info gives the device's own.")


def _settings_setter(original: Callable) -> Callable:
    def set_allocator_settings(text, *args, **kwargs):
        result = original(text, *args, **kwargs)
        if _C.is_installed() and isinstance(text, str):
            _C.apply_changed_torch_settings(text, fixed["segments"], fixed["release_threshold"])
        return result
    return set_allocator_settings
