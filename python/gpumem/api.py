"""The public functions. Each one validates everything before it changes anything, and its
arguments before it asks for a device: a typo is reported as one on a machine without a GPU too.

Errors, the same in every call: a bad value raises ValueError (TypeError for a value of the wrong
type) naming it and the accepted forms; a device that does not exist where others do, ValueError
naming the ones there are; no CUDA device visible at all, RuntimeError ("gpumem: no CUDA device
is visible to this process"; its class is gpumem.settings.devices.NoDeviceError); PyTorch's own allocator
already in use, RuntimeError saying how to enable gpumem first.
"""
from __future__ import annotations

import numbers
import threading
import warnings
from typing import Optional

import torch

import gpumem._C as _C
from gpumem import _torch_hooks, sharing
from gpumem.monitoring import startup
from gpumem.settings import chunk as _chunk, devices as _devices, environment, floors, limits as _limits, scope as _scope, segments
from gpumem.settings.devices import Device
from gpumem.settings.echo import shown
from gpumem.settings.limits import Limit

# Installing and applying GPUMEM_LIMIT and GPUMEM_SEGMENTS happen once; a set_limit or set_segments
# racing with it must come after.
_lock = threading.Lock()

_TORCH_ALLOCATOR_IN_USE = (
    "gpumem: PyTorch has already initialized CUDA with its own allocator in this process, and an "
    "allocator cannot be swapped once it is in use. Enable gpumem before any CUDA work: call "
    "gpumem.set_limit(...) or gpumem.enable() right after `import torch`, or set GPUMEM_LIMIT "
    "(e.g. GPUMEM_LIMIT=4GB) before the process starts and call gpumem.enable() first thing. "
    "Nothing was changed; this process goes on with PyTorch's own allocator."
)


def set_limit(limit: Limit, device: Device = None, scope: Optional[str] = None, floor: Limit = None) -> None:
    """Caps the CUDA memory PyTorch may reserve: on every visible device, or on `device`.

    `limit` is a spec ("4GB", "512 MiB", "50%", "0.5", "none"), an int byte count, a float
    fraction of the device in (0, 1], or None for no limit. `scope` says what the limit bounds:
    "allocator" (what gpumem reserves, torch.cuda.memory_reserved()) or "process" (everything
    the driver counts for the process on the device, as nvidia-smi shows it: gpumem's memory plus
    the CUDA context, library workspaces and NCCL's buffers; see docs/usage.md). None keeps each
    device's scope (GPUMEM_SCOPE's, else "allocator"). The first call installs gpumem as
    PyTorch's CUDA allocator (GPUMEM_LIMIT applies first, then this limit). A bad value, or a
    value that does not fit one of the devices, raises and changes nothing; the errors are the
    module's (see its docstring).

    `floor` (in the same forms, or None for none) is memory the other gpumem processes on the same
    GPU leave for this one: the process joins the GPU's table (docs/usage.md, "Sharing a GPU"),
    and a floor the device cannot give now is reported at once with a RuntimeWarning and honoured
    as the others free memory. A floor above the limit raises ValueError.
    """
    spec = _limits.spec_of(limit)
    _limits.check_syntax(spec)
    floor_spec = None if floor is None else _limits.spec_of(floor)
    if floor_spec is not None and floor_spec.strip().lower() not in floors.NO_FLOOR:
        _limits.check_syntax(floor_spec)
    scope = None if scope is None else _scope.scope(scope)
    with _lock:
        _refuse_if_torch_allocator_in_use()
        limits = _limits.resolve(spec, _devices.targets(device))
        _enable_locked()
        _apply(limits)
        if scope is not None:  # after the limits: the scope releases down to the new limit, not the old
            for index in limits:
                _C.set_scope(index, scope)
    if floor_spec is not None:
        floors = {index: floors.floor_bytes(floor_spec, _devices.total(index), _C.get_limit(index)) for index in limits}
        for index, nbytes in floors.items():
            sharing.join(index)
            sharing.set_floor(index, nbytes)


def get_scope(device: Device = None) -> str:
    """What the limit on `device` (the current device for None) bounds: "allocator" or "process"."""
    return _C.get_scope(_devices.index(device))


def get_limit(device: Device = None) -> int:
    """The cap in bytes on `device` (the current device for None)."""
    return _C.get_limit(_devices.index(device))


def set_segments(kind: str, device: Device = None, chunk: Optional[int | str] = None) -> None:
    """Where new memory comes from, on every visible device or on `device`.

    "growable" (the default where the driver supports CUDA virtual memory management): segments
    that reserve an address range and map pages of device memory into it as they grow, so pages
    freed in one place can serve a larger request elsewhere. "plain": one cudaMalloc per
    segment. Memory already reserved stays as it is; the kind applies to new memory. A device
    that cannot map pages keeps plain segments, with a warning. The first call installs gpumem
    as PyTorch's CUDA allocator (GPUMEM_LIMIT, GPUMEM_SEGMENTS and GPUMEM_CHUNK apply first, then
    this kind).

    `chunk` ("16MB", a byte count; GPUMEM_CHUNK's forms) sets the least chunk growable segments
    map large requests in (gpumem.settings.chunk): pages (0, the default) fit a tight cap best;
    16MB makes tensors sent to other processes open as fast as PyTorch's. A bad kind or chunk
    raises and changes nothing.
    """
    growable = segments.growable(kind)
    chunk_bytes = None if chunk is None else _chunk.chunk_bytes(chunk)
    with _lock:
        _refuse_if_torch_allocator_in_use()
        devices = _devices.targets(device)
        _enable_locked()
        _apply_segments(devices, growable)
        if chunk_bytes is not None:
            for index in devices:
                _C.set_large_chunk(index, chunk_bytes)
        _torch_hooks.fixed["segments"] = True


def get_chunk(device: Device = None) -> int:
    """The bytes of the chunks growable segments map large requests in on `device` (the current
    device for None): set_segments' `chunk` or GPUMEM_CHUNK as the least power-of-two number of
    pages at least that, a page by default; 0 where the device cannot map pages."""
    return _C.get_large_chunk(_devices.index(device))


def get_segments(device: Device = None) -> str:
    """The segment kind in effect on `device` (the current device for None): "growable" or "plain".

    "plain" where growable segments were asked for but the device cannot map pages.
    """
    return segments.kind(_C.get_growable(_devices.index(device)))


def enable() -> None:
    """Installs gpumem as PyTorch's CUDA allocator, with GPUMEM_LIMIT's limits and GPUMEM_SEGMENTS's
    segment kind where they are set, and the sharing GPUMEM_SHARE=on or GPUMEM_FLOOR asks for.

    Starts no CUDA: the variables' syntax is checked now (ValueError), and what they mean on the
    devices when they are first used (torch's CUDA init, or the next gpumem call that names a
    device), which raise if they do not fit them (for sharing, torch's CUDA init: see
    gpumem.sharing). torch's allocator settings apply then too (see docs/usage.md, "Which setting
    wins").
    """
    with _lock:
        _enable_locked()


def is_enabled() -> bool:
    return _C.is_installed()


def empty_cache() -> None:
    """Returns every cached, unused segment of every device to CUDA."""
    _C.empty_cache()


def stats(device: Device = None) -> dict[str, int]:
    """The statistics of `device`, keyed as torch.cuda.memory_stats keys them."""
    return _C.stats(_devices.index(device))


def reset_peak_stats(device: Device = None) -> None:
    _C.reset_peak_stats(_devices.index(device))


def set_release_threshold(share: float, device: Device = None) -> None:
    """Once reserved memory passes `share` of the limit, cached segments are released, oldest first.

    `share` is in (0, 1]; 0 turns the policy off. Applies to every visible device, or to `device`.
    """
    if isinstance(share, bool) or not isinstance(share, numbers.Real):
        raise TypeError(f"gpumem: release threshold {shown(share)} is not a number in [0, 1]")
    if not 0 <= share <= 1:  # as the compiled layer checks it, but before any device is asked
        raise ValueError(f"gpumem: bad release threshold {shown(share)}: expected a share of the limit in "
                         "(0, 1], or 0 to turn it off")
    for index in _devices.targets(device):
        _C.set_release_threshold(index, float(share))
    _torch_hooks.fixed["release_threshold"] = True


def device_mem_info(device: Device = None) -> tuple[int, int]:
    """(free, total) bytes of the device itself, as CUDA reports them: what torch.cuda.mem_get_info
    returns without gpumem. Under gpumem torch.cuda.mem_get_info gives the capped view (total = the
    limit, free = what could still be reserved under it), unless set_mem_info_view("device")."""
    return _torch_hooks.device_mem_info(_devices.index(device))


def set_mem_info_view(view: str) -> None:
    """What torch.cuda.mem_get_info (and torch.accelerator's memory info) report under gpumem:
    "capped" (the default; also GPUMEM_MEM_INFO=capped) or "device" (the device's own figures).
    torch.cuda.get_device_properties always gives the device's own total."""
    _torch_hooks.set_view(view)


def _enable_locked() -> None:
    if _C.is_installed():
        return
    _refuse_if_torch_allocator_in_use()
    # Touches no CUDA: the compiled layer applies GPUMEM_LIMIT and GPUMEM_SEGMENTS (and torch's own
    # allocator settings) when the devices are first used, before any later gpumem call.
    text, growable, view = environment.limit_text(), environment.segments(), environment.mem_info_view()
    warn_at, metrics_port, publish_dir = environment.warn_at(), environment.metrics_port(), environment.publish_dir()
    metrics_addr, share = environment.metrics_addr(), environment.sharing_asked()
    _C.install(text, growable, environment.scope(), environment.chunk())
    _torch_hooks.install()
    if growable is not None:
        _torch_hooks.fixed["segments"] = True
    if view is not None:
        _torch_hooks.set_view(view)
    if share:  # queued first: while it raises, CUDA init stops before the monitoring starts
        sharing.start_at_cuda_init()
    startup.start(warn_at, metrics_port, publish_dir, metrics_addr)


def _refuse_if_torch_allocator_in_use() -> None:
    if torch.cuda.is_initialized() and not _C.is_installed():
        raise RuntimeError(_TORCH_ALLOCATOR_IN_USE)


def _apply(limits: dict[int, Optional[int]]) -> None:
    for device, nbytes in limits.items():
        _C.set_limit_bytes(device, nbytes)


def _apply_segments(devices, growable: bool) -> None:
    for device in devices:
        _C.set_growable(device, growable)
    if not growable:
        return
    unsupported = [device for device in devices if not _C.growable_supported(device)]
    if unsupported:
        names = ", ".join(str(d) for d in unsupported)
        warnings.warn(
            f"gpumem: growable segments were asked for, but CUDA device(s) {names} cannot map memory "
            "pages (the driver lacks CUDA virtual memory management); they keep plain segments.",
            RuntimeWarning, stacklevel=3)
