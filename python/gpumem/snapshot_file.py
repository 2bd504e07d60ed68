"""Reading a memory snapshot written by torch.cuda.memory._dump_snapshot, safely.

A snapshot is a pickle of plain dicts, lists, strings and numbers:

    {"segments": [segment, ...],             # the allocator's segments when it was dumped
     "device_traces": [[event, ...], ...],   # one list per device, oldest event first
     "allocator_settings": {...}}            # optional

Loading an arbitrary pickle can run code, so the unpickler here refuses every global: a real
snapshot names none, and a pickle that does is rejected before anything in it is called.
Every problem raises SnapshotError (a ValueError) naming the file and what is wrong.

gpumem also reads one optional key torch does not write, "gpumem_device_totals": the total memory
of each device in bytes (a list by device index, or a dict), so that a replay can use the real
device size; without it a replay sizes its simulated device from the trace.
"""
from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

ACTIONS = frozenset(
    {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
     "segment_unmap", "snapshot", "oom"}
)
BLOCK_STATES = frozenset({"active_allocated", "active_pending_free", "inactive"})
DEVICE_TOTALS_KEY = "gpumem_device_totals"

_ALLOC_OR_FREE = frozenset({"alloc", "free_requested", "free_completed"})
_RECORD_HINT = (
    "record one with torch.cuda.memory._record_memory_history(enabled='all') before the work runs, "
    "then torch.cuda.memory._dump_snapshot(path)"
)

Source = Union[str, "os.PathLike[str]"]


class SnapshotError(ValueError):
    """A file that is not a usable memory snapshot; the message names the file and the problem."""


class Event(NamedTuple):
    """One trace entry. `time_us` is the entry's index when the snapshot has no times."""

    index: int
    action: str
    addr: int
    size: int
    stream: int
    time_us: int


@dataclass(frozen=True)
class Block:
    address: int
    size: int
    requested_size: int
    state: str

    @property
    def active(self) -> bool:
        """Allocated, or freed but still in use on a stream: either way it holds memory."""
        return self.state != "inactive"


@dataclass(frozen=True)
class Segment:
    device: int
    address: int
    total_size: int
    allocated_size: int
    stream: int
    segment_type: str
    blocks: tuple[Block, ...]


@dataclass
class Snapshot:
    source: str
    segments: list[Segment]
    traces: dict[int, list[Event]]
    allocator_settings: dict = field(default_factory=dict)
    device_totals: dict[int, int] = field(default_factory=dict)
    has_times: bool = True

    def devices(self) -> list[int]:
        """Devices whose trace holds at least one alloc or free, in order."""
        return [d for d, events in sorted(self.traces.items()) if _has_alloc_or_free(events)]

    def events(self, device: int) -> list[Event]:
        if device not in self.traces or not _has_alloc_or_free(self.traces[device]):
            have = ", ".join(str(d) for d in self.devices())
            raise SnapshotError(
                f"{self.source}: device {device} has no alloc or free events (devices with events: {have})")
        return self.traces[device]

    def segments_of(self, device: int) -> list[Segment]:
        return [s for s in self.segments if s.device == device]


def load(path: Source) -> Snapshot:
    """Reads and checks the snapshot at `path`; SnapshotError if it is not one."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        raise SnapshotError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise SnapshotError(f"{name}: is a directory, not a snapshot file") from None
    except OSError as error:
        raise SnapshotError(f"{name}: cannot be read ({error.strerror or error})") from None
    return from_dict(_unpickle(data, name), name)


def from_dict(data: Any, source: str = "<snapshot>") -> Snapshot:
    """Checks an already unpickled snapshot (as torch.cuda.memory._snapshot() returns it)."""
    shape = _Shape(source)
    top = shape.mapping(data, "the top level", ("segments", "device_traces"))
    per_device = shape.sequence(top["device_traces"], "device_traces")
    traces = {d: _events(shape, entries, d) for d, entries in enumerate(per_device)}
    snapshot = Snapshot(
        source=source,
        segments=[_segment(shape, s, i) for i, s in enumerate(shape.sequence(top["segments"], "segments"))],
        traces=traces,
        allocator_settings=top.get("allocator_settings") or {},
        device_totals=_device_totals(shape, top.get(DEVICE_TOTALS_KEY)),
        has_times=all("time_us" in e for entries in top["device_traces"] for e in entries if isinstance(e, dict)),
    )
    if not snapshot.devices():
        raise SnapshotError(f"{source}: the trace is empty: no device has an alloc or free event; {_RECORD_HINT}")
    return snapshot


# ---- unpickling ---------------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")


class _NoGlobalsUnpickler(pickle.Unpickler):
    # Every class, function and extension code a pickle names reaches find_class; refusing them all
    # leaves only plain data, and nothing in the file is ever called.
    def find_class(self, module: str, name: str):
        raise _Refused(module, name)


def _unpickle(data: bytes, name: str) -> Any:
    try:
        return _NoGlobalsUnpickler(io.BytesIO(data)).load()
    except _Refused as refused:
        raise SnapshotError(
            f"{name}: refused: the pickle names the global {refused} (a class or function). A memory "
            "snapshot holds only dicts, lists, strings and numbers, and loading a global could run "
            "code, so gpumem never loads one"
        ) from None
    except Exception as error:  # a damaged or foreign file can fail in any of pickle's ways
        raise SnapshotError(
            f"{name}: not a pickle ({type(error).__name__}: {error}); expected a file written by "
            "torch.cuda.memory._dump_snapshot"
        ) from None


# ---- shape checks -------------------------------------------------------------------------------


class _Shape:
    """Checks of the snapshot's structure, each raising SnapshotError with the place in the file."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, what: str) -> SnapshotError:
        return SnapshotError(
            f"{self.source}: not a memory snapshot: {where} {what}; expected what "
            "torch.cuda.memory._dump_snapshot writes"
        )

    def mapping(self, value: Any, where: str, keys: tuple[str, ...]) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"is a {type(value).__name__}, not a dict")
        missing = [k for k in keys if k not in value]
        if missing:
            raise self.fail(where, f"has no {', '.join(repr(k) for k in missing)}")
        return value

    def sequence(self, value: Any, where: str) -> Union[list, tuple]:
        if not isinstance(value, (list, tuple)):
            raise self.fail(where, f"is a {type(value).__name__}, not a list")
        return value

    def integer(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"is {value!r}, not an integer")
        return value

    def text(self, value: Any, where: str, allowed: frozenset) -> str:
        if value not in allowed:
            raise self.fail(where, f"is {value!r}, not one of {', '.join(sorted(allowed))}")
        return value


def _events(shape: _Shape, entries: Any, device: int) -> list[Event]:
    where = f"device_traces[{device}]"
    return [_event(shape, e, i, f"{where}[{i}]") for i, e in enumerate(shape.sequence(entries, where))]


def _event(shape: _Shape, entry: Any, index: int, where: str) -> Event:
    entry = shape.mapping(entry, where, ("action",))
    action = shape.text(entry["action"], f"{where}['action']", ACTIONS)
    needed = ("addr", "size") if action in _ALLOC_OR_FREE else ()
    shape.mapping(entry, where, needed)
    return Event(
        index=index,
        action=action,
        addr=shape.integer(entry.get("addr", 0), f"{where}['addr']"),
        size=shape.integer(entry.get("size", 0), f"{where}['size']"),
        stream=shape.integer(entry.get("stream", 0), f"{where}['stream']"),
        time_us=shape.integer(entry.get("time_us", index), f"{where}['time_us']"),
    )


def _segment(shape: _Shape, entry: Any, index: int) -> Segment:
    where = f"segments[{index}]"
    entry = shape.mapping(entry, where, ("address", "total_size", "blocks"))
    address = shape.integer(entry["address"], f"{where}['address']")
    blocks, offset = [], 0
    for i, block in enumerate(shape.sequence(entry["blocks"], f"{where}['blocks']")):
        at = f"{where}['blocks'][{i}]"
        block = shape.mapping(block, at, ("size", "state"))
        size = shape.integer(block["size"], f"{at}['size']")
        # Older snapshots leave the address out: blocks tile the segment in address order.
        blocks.append(Block(
            address=shape.integer(block.get("address", address + offset), f"{at}['address']"),
            size=size,
            requested_size=shape.integer(block.get("requested_size", size), f"{at}['requested_size']"),
            state=shape.text(block["state"], f"{at}['state']", BLOCK_STATES),
        ))
        offset += size
    return Segment(
        device=shape.integer(entry.get("device", 0), f"{where}['device']"),
        address=address,
        total_size=shape.integer(entry["total_size"], f"{where}['total_size']"),
        allocated_size=shape.integer(entry.get("allocated_size", 0), f"{where}['allocated_size']"),
        stream=shape.integer(entry.get("stream", 0), f"{where}['stream']"),
        segment_type=str(entry.get("segment_type", "")),
        blocks=tuple(blocks),
    )


def _device_totals(shape: _Shape, value: Any) -> dict[int, int]:
    if value is None:
        return {}
    items = value.items() if isinstance(value, dict) else enumerate(shape.sequence(value, DEVICE_TOTALS_KEY))
    totals = {}
    for device, total in items:
        where = f"{DEVICE_TOTALS_KEY}[{device!r}]"
        totals[shape.integer(device, where)] = shape.integer(total, where)
    return totals


def _has_alloc_or_free(events: list[Event]) -> bool:
    return any(e.action in _ALLOC_OR_FREE for e in events)

