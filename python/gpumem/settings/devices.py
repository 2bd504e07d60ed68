"""Which CUDA devices a call means, numbered as CUDA numbers them (CUDA_VISIBLE_DEVICES applies).

Where no CUDA device is visible at all, every call that needs one raises NoDeviceError, a
RuntimeError: the machine, not the argument, is what is wrong. A device that does not exist where
others do is a bad argument: ValueError, naming the devices there are.
"""
from __future__ import annotations

import numbers
from typing import Union

import torch

import gpumem._C as _C
from gpumem.settings.echo import shown

Device = Union[int, str, torch.device, None]


class NoDeviceError(RuntimeError):
    """No CUDA device is visible to this process."""

    def __init__(self) -> None:
        super().__init__("gpumem: no CUDA device is visible to this process (see CUDA_VISIBLE_DEVICES)")


def current() -> int:
    # torch.cuda.current_device() initializes CUDA, and with it PyTorch's own allocator, which then
    # can no longer be swapped out; before that CUDA's current device is 0.
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def every() -> list[int]:
    return list(range(_count()))


def index(device: Device) -> int:
    """The index of 1, "cuda:1" or torch.device("cuda", 1); None (or "cuda") is the current device."""
    if device is None:
        _count()
        return current()
    if isinstance(device, bool):
        raise TypeError(f"gpumem: device {device} is a bool; give an index, 'cuda:N' or a torch.device")
    if isinstance(device, numbers.Integral):
        return _checked(int(device))
    if isinstance(device, str):
        device = _parse(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"gpumem: {shown(str(device))} is not a CUDA device")
        return index(None) if device.index is None else _checked(device.index)
    raise TypeError(
        f"gpumem: device {shown(device)} ({type(device).__name__}) is not an index, 'cuda:N' or a torch.device"
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
        raise ValueError(f"gpumem: {shown(text)} is not a device; give an index, 'cuda:N' or a torch.device") from None


def _checked(device: int) -> int:
    count = _count()
    if not 0 <= device < count:
        raise ValueError(
            f"gpumem: there is no CUDA device {shown(device)}; this process sees devices 0..{count - 1} "
            "(CUDA_VISIBLE_DEVICES applies)"
        )
    return device


def _count() -> int:
    count = _C.device_count()
    if count == 0:
        raise NoDeviceError()
    return count
