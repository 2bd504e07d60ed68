"""Regions: memory a process parks and gets back at the same addresses.

    with gpumem.region("engine", backup=True):  # this thread's CUDA allocations are the region's
        engine = build_engine()
    gpumem.pause("engine")                 # its memory goes back to the device, contents to the host
    ...                                    # other work uses that memory
    gpumem.resume("engine")                # mapped again where it was, contents copied back

A region's memory lies on growable segments (whatever the process's default), so pausing it unmaps
the physical memory of its live tensors and of its cache and resuming maps it again at the same
addresses: tensors, their views and CUDA graphs captured over them stay valid. Touching a paused
tensor (a kernel reading it) is an error of the program: its memory is not there. docs/usage.md,
"Pausing memory", says what each call does; docs/design.md how.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

import gpumem._C as _C
from gpumem import api
from gpumem.settings import devices as _devices
from gpumem.settings.devices import Device
from gpumem.settings.echo import shown

_lock = threading.Lock()
_serials: dict[str, int] = {}          # tag -> the region's serial, one per tag
_backups: dict[str, bool] = {}         # tag -> whether a pause copies its contents to the host
_made: set[tuple[int, int]] = set()     # (device, serial) of the regions made on a device
_paused: dict[tuple[int, int], int] = {}  # (device, serial) -> the bytes its pause gave back


def _checked_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"gpumem: region tag {shown(tag)} is not a non-empty string; give a name such as \"kv_cache\"")
    return tag


def _checked_backup(backup: object) -> bool:
    if not isinstance(backup, bool):
        raise TypeError(f"gpumem: backup {shown(backup)} is not a bool; give True (copy the contents to the host "
                        "and back), False (drop them) or None (as the region was made)")
    return backup


@contextlib.contextmanager
def region(tag: str, backup: Optional[bool] = None, device: Device = None) -> Iterator[None]:
    """Inside the block, the CUDA allocations this thread makes on `device` (the current one if
    None) come from the region `tag`, made on first use; outside it they come from the process's
    memory as before. `backup`: whether pausing the region copies its tensors' contents to the
    host and resuming copies them back (weights, an optimizer's state), or drops them (a KV cache
    refilled after); fixed when the tag is first used (None: as it was made, False for a new one),
    a different one raising ValueError. A region may be entered again later, from
    any thread, and nested in another. Installs gpumem if it is not yet PyTorch's allocator."""
    _checked_tag(tag)
    if backup is not None:
        _checked_backup(backup)
    index = _devices.index(device)
    if not api.is_enabled():
        api.enable()
    with _lock:
        backup = _backups.get(tag, False) if backup is None else backup
        if _backups.get(tag, backup) != backup:
            raise ValueError(f"gpumem: region {shown(tag)} was made with backup={_backups[tag]}; a region keeps "
                             f"its backup setting: enter it with backup={_backups[tag]}, or use another tag")
        serial = _serials.get(tag, len(_serials) + 1)
        if (index, serial) in _paused:
            raise RuntimeError(f"gpumem: region {shown(tag)} is paused on device {index}: resume it "
                               f"(gpumem.resume({tag!r})) before allocating in it")
        if (index, serial) not in _made:
            _C.region_create(index, serial)  # where it cannot be made, nothing is recorded
            _made.add((index, serial))
        _serials[tag], _backups[tag] = serial, backup
        _C.region_begin(index, serial)
    try:
        yield
    finally:
        _C.region_end(index, serial)


def _chosen(tag: Optional[str], device: Device) -> list[tuple[int, int, str]]:
    """(device, serial, tag) of the regions a pause or a resume names: `tag`'s, or every region,
    on `device` or every device it was made on."""
    if tag is not None:
        _checked_tag(tag)
        if tag not in _serials:
            known = ", ".join(repr(t) for t in _serials) or "none yet"
            raise ValueError(f"gpumem: no region {shown(tag)}: regions are made by `with gpumem.region(tag):` "
                             f"(made so far: {known})")
    indices = None if device is None else {_devices.index(device)}
    tags = {serial: name for name, serial in _serials.items()}
    return [(index, serial, tags[serial]) for index, serial in sorted(_made)
            if (indices is None or index in indices) and (tag is None or tags[serial] == tag)]


def pause(tag: Optional[str] = None, device: Device = None) -> int:
    """Gives the memory of region `tag` (every region if None) back to the device: its cache and
    its live tensors' memory, after waiting for the work queued on the device and, for a region
    made with backup=True, copying their contents to pinned host memory (held from the region's
    last pause or prepare_backups where it covers the same memory, see drop_backups). Their addresses stay
    reserved. With no tag, the process's other cached memory goes back too (empty_cache). Returns the bytes the regions gave
    back; a region paused already gives none. Raises RuntimeError inside a region's block or a
    graph capture (nothing changes)."""
    paused = 0
    with _lock:
        for index, serial, name in _chosen(tag, device):
            if (index, serial) in _paused:
                continue
            bytes_paused = _C.region_pause(index, serial, _backups[name])
            _paused[(index, serial)] = bytes_paused
            paused += bytes_paused
    if tag is None:
        torch.cuda.empty_cache()
    return paused


def resume(tag: Optional[str] = None, device: Device = None) -> int:
    """Maps the memory of paused region `tag` (every paused region if None) again at the same
    addresses, under the limit, and copies back what was backed up. Returns the bytes mapped again.
    Where the limit or the device cannot hold a region, raises torch.OutOfMemoryError naming its
    paused bytes: that region stays paused, its tensors intact (resume again once memory is free);
    regions resumed before it stay resumed."""
    resumed = 0
    with _lock:
        for index, serial, name in _chosen(tag, device):
            if (index, serial) not in _paused:
                continue
            try:
                resumed += _C.region_resume(index, serial)
            except _C.OutOfMemoryError as error:
                raise torch.OutOfMemoryError(f"gpumem: region {name!r} on device {index}: {error}") from None
            del _paused[(index, serial)]
    return resumed


def drop_backups(tag: Optional[str] = None, device: Device = None) -> int:
    """Frees the pinned host memory that region `tag` (every region if None) holds for its next
    pause, kept after its last resume or pinned by prepare_backups; that pause then pins new host
    memory. A paused region keeps its own (resume copies it back). Returns the bytes freed."""
    dropped = 0
    with _lock:
        for index, serial, name in _chosen(tag, device):
            if (index, serial) not in _paused:
                dropped += _C.region_drop_backup(index, serial)
    return dropped


def prepare_backups(tag: Optional[str] = None, device: Device = None) -> int:
    """Pins host memory now for the next pause of region `tag` (every region made with backup=True
    if None), enough for every chunk of device memory it has mapped, its cache included: that
    pause then copies at the link's speed, even the first (pinning new host memory is many times
    slower than the copy). Memory the region holds already, kept from its last pause or prepared
    before, is not pinned again; held memory that no longer matches its chunks is freed. The
    device's allocations go on while it pins, and a thread may run it beside other work. Returns
    the bytes pinned; 0 for a paused region. Raises ValueError for a region made with
    backup=False (its pause keeps no copy)."""
    with _lock:
        chosen = _chosen(tag, device)
        if tag is not None and not _backups[tag]:
            raise ValueError(f"gpumem: region {shown(tag)} was made with backup=False: its pause drops its contents "
                             "and needs no host memory; prepare a region made with backup=True")
        chosen = [(index, serial) for index, serial, name in chosen if _backups[name]]
    # No lock while pinning: pause, resume and the regions' blocks go on (the core keeps what it
    # pinned only where a pause meanwhile has not backed up the same memory).
    return sum(_C.region_prepare_backup(index, serial) for index, serial in chosen)


def paused(device: Device = None) -> dict[str, int]:
    """The regions paused now, by tag: the bytes each gave back, summed over `device` (every
    device if None)."""
    with _lock:
        found = _chosen(None, device)
        out: dict[str, int] = {}
        for index, serial, name in found:
            if (index, serial) in _paused:
                out[name] = out.get(name, 0) + _paused[(index, serial)]
        return out
