"""Which CUDA devices a call means, numbered as CUDA numbers them (CUDA_VISIBLE_DEVICES applies)."""
from __future__ import annotations

import numbers
from typing import Union

import torch

from gpumem import _C

Device = Union[int, str, torch.device, None]


def current() -> int:
    # torch.cuda.current_device() initializes CUDA, and with it PyTorch's own allocator, which then
    # can no longer be swapped out; before that CUDA's current device is 0.
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def every() -> list[int]:
    count = _C.device_count()
    if count == 0:
        raise RuntimeError("gpumem: no CUDA device is visible to this process (see CUDA_VISIBLE_DEVICES)")
    return list(range(count))


def index(device: Device) -> int:
    """The index of 1, "cuda:1" or torch.device("cuda", 1); None (or "cuda") is the current device."""
    if device is None:
        return current()
    if isinstance(device, bool):
        raise TypeError(f"gpumem: device {device!r} is a bool; give an index, 'cuda:N' or a torch.device")
    if isinstance(device, numbers.Integral):
        return _checked(int(device))
    if isinstance(device, str):
        device = _parse(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"gpumem: {str(device)!r} is not a CUDA device")
        return current() if device.index is None else _checked(device.index)
    raise TypeError(
        f"gpumem: device {device!r} ({type(device).__name__}) is not an index, 'cuda:N' or a torch.device"
    )


def targets(device: Device) -> list[int]:
    """Every visible device for None, else the one named."""
    return every() if device is None else [index(device)]


def total(device: int) -> int:
    """The device's memory in bytes: what percentages and fractions in a limit are of."""
    return _C.device_total(device)


def _parse(text: str) -> torch.device:
    try:
        return torch.device(text)
    except RuntimeError:
        raise ValueError(f"gpumem: {text!r} is not a device; give an index, 'cuda:N' or a torch.device") from None


def _checked(device: int) -> int:
    count = _C.device_count()
    if not 0 <= device < count:
        visible = f"devices 0..{count - 1}" if count else "no device"
        raise ValueError(
            f"gpumem: there is no CUDA device {device}; this process sees {visible} "
            "(CUDA_VISIBLE_DEVICES applies)"
        )
    return device
