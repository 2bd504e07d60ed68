"""Reading a memory snapshot written by torch.cuda.memory._dump_snapshot, safely.

A snapshot is a pickle of plain dicts, lists, strings and numbers:

    {"segments": [segment, ...],             # the allocator's segments when it was dumped
     "device_traces": [[event, ...], ...],   # one list per device, oldest event first
     "allocator_settings": {...}}            # optional

gpumem also reads one optional key torch does not write, "gpumem_device_totals": the total memory
of each device in bytes (a list by device index, or a dict), so that a replay can use the real
device size; without it a replay sizes its simulated device from the trace.

Snapshots are passed around, so every file is hostile: reading one takes time and memory bounded
by its size, and every problem raises SnapshotError (a ValueError) naming the file and the place
in it. What the reader refuses:

- anything but a regular file (a FIFO, a device, a directory), before reading a byte of it;
- a file larger than the cap, MAX_FILE_SIZE (256 MiB) unless load's max_size says otherwise
  (gpumem replay --max-size), by its size alone, before reading a byte of it;
- a file that does not start as a pickle of protocol 2 to 5 does ("\\x80" and the protocol), before
  reading the rest. torch writes protocol 4 (Python's default); protocols 0 and 1 have no header
  to test, so any text file could pass for one, and they are refused;
- any pickle opcode but those Python writes for plain data: so no global (a class or function,
  which loading could call), no set, no persistent id. The pickle is read by the small reader
  in plain_data, not by pickle.Unpickler, which can be made to allocate gigabytes by a ten-byte file (a
  memo index far past the values stored) or to hash for ever (a dict key that is a tuple built
  from shared references). Dict keys must be strings, bytes, floats, None, booleans or integers of
  at most 64 bits; their hashes then cost at most their size, once. The reader reads the file as
  it goes, a MiB at a time, so a file that goes wrong at byte 2 is refused after reading one; and it
  refuses a pickle whose values would take more than 48 bytes of memory per byte of the file
  (Note [memory] in plain_data: the pickler's own output takes at most 44), so reading a file of
  the default cap's size takes at most some 12 GiB;
- a container the reader walks (the trace of a device, an event, the segment list, a segment, a
  block list, a block) that is the same object as one walked already: shared references could
  otherwise make a small file hold 10^8 events. torch shares only what the reader never walks
  ("frames" lists, strings). As a backstop, the entries walked are at most 4 per byte of the
  file;
- a value of the wrong type, checked before anything walks, hashes, compares or echoes it, and a
  number out of range: sizes (size, requested_size, total_size, allocated_size) from 0 to
  MAX_BYTES (2^62); addresses from 0 to 2^64 - 1; device totals from 1 to MAX_BYTES; device
  indices from 0 to MAX_DEVICES - 1 (1023), and at most MAX_DEVICES traces or totals; streams from
  -2^63 to 2^64 - 1; time_us from -2^63 to 2^63 - 1.

"allocator_settings" is kept when it is a dict, never walked (whoever reads it must treat it as
hostile too), and dropped (read as {}) when it is anything else. Messages show a value from the
file only when it is a short scalar: strings are cut at 40 characters, containers and integers
past 40 digits are named by kind and size.

from_dict applies the same checks to data already in memory, the sharing rule included: torch's
own torch.cuda.memory._snapshot() builds a new dict for each event, segment and block, and shares
only "frames" lists. Its work is bounded by the data it is given, so it has no budget.
"""
from __future__ import annotations

import os
import pickle
import stat
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union

from gpumem.settings.files import read_at_most
from gpumem.trace.plain_data import BadPickle, PlainReader, Refused, TooLarge, describe

ACTIONS = frozenset(
    {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
     "segment_unmap", "snapshot", "oom"}
)
BLOCK_STATES = frozenset({"active_allocated", "active_pending_free", "inactive"})
DEVICE_TOTALS_KEY = "gpumem_device_totals"
MAX_DEVICES = 1024
MAX_BYTES = 1 << 62  # sizes and totals in a file; replay's simulated device takes at most _C.SIM_MAX_CAPACITY
MAX_FILE_SIZE = 256 << 20  # the default cap on a file's size: see the module's docstring

_ALLOC_OR_FREE = frozenset({"alloc", "free_requested", "free_completed"})
_RECORD_HINT = (
    "record one with torch.cuda.memory._record_memory_history(enabled='all') before the work runs, "
    "then torch.cuda.memory._dump_snapshot(path)"
)
_EXPECTED = "expected a file written by torch.cuda.memory._dump_snapshot"
_WALK_PER_BYTE = 4  # every entry walked takes at least one byte of a file; this is a backstop
_WALK_SLACK = 1024

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
    allocator_settings: dict = field(default_factory=dict)  # as the file holds it: not checked
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


def load(path: Source, max_size: int = MAX_FILE_SIZE) -> Snapshot:
    """Reads and checks the snapshot at `path`; SnapshotError if it is not one or is larger than
    `max_size` bytes (a positive int; MAX_FILE_SIZE by default)."""
    name = os.fspath(path)
    _check_max_size(max_size)
    fd = _open(name)
    try:
        size = _regular_size(fd, name)
        if size > max_size:
            raise SnapshotError(f"{name}: is {size} bytes, larger than the cap of {max_size} bytes "
                                f"({_mib(max_size)}) on a snapshot file; {_RAISE_CAP}")
        header = read_at_most(fd, _HEADER)
        _check_header(header, name)
        # Read as the reader goes, and no more than the size fstat gave: a file that grows adds nothing.
        data = _unpickle(PlainReader(header, lambda count: read_at_most(fd, count), size), name)
    except OSError as error:
        raise SnapshotError(f"{name}: cannot be read ({error.strerror or error})") from None
    finally:
        os.close(fd)
    return _check(_Shape(name, budget=_WALK_PER_BYTE * size + _WALK_SLACK), data)


def loads(data: bytes, source: str = "<snapshot>") -> Snapshot:
    """Reads and checks the bytes of a snapshot file, as load does a file (there is no cap: they are
    in memory already); SnapshotError naming `source` if they are not one."""
    _check_header(data[:_HEADER], source)
    snapshot = _unpickle(PlainReader(data), source)
    return _check(_Shape(source, budget=_WALK_PER_BYTE * len(data) + _WALK_SLACK), snapshot)


def from_dict(data: Any, source: str = "<snapshot>") -> Snapshot:
    """Checks an already unpickled snapshot (as torch.cuda.memory._snapshot() returns it)."""
    return _check(_Shape(source, budget=None), data)


# ---- reading the file ---------------------------------------------------------------------------

_HEADER = 2  # PROTO and its version, which every pickle of protocol 2 to 5 starts with
_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_RAISE_CAP = "a larger one is max_size of gpumem.snapshot_file.load, --max-size of gpumem replay"


def _check_max_size(max_size: object) -> None:
    if isinstance(max_size, bool) or not isinstance(max_size, int):
        raise TypeError(f"gpumem: snapshot max_size {max_size!r:.60} is not an int number of bytes")
    if max_size < 1:
        raise ValueError(f"gpumem: snapshot max_size {max_size!r:.60} is not a positive number of bytes")


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.0f} MiB" if count >= 1 << 20 else f"{count} bytes"


def _open(name: str) -> int:
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer, for ever.
        return os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotError(f"{name}: no such file") from None
    except OSError as error:
        raise SnapshotError(f"{name}: cannot be read ({error.strerror or error})") from None


def _regular_size(fd: int, name: str) -> int:
    info = os.fstat(fd)
    for test, kind in _NOT_REGULAR:
        if test(info.st_mode):
            raise SnapshotError(f"{name}: is {kind}, not a snapshot file")
    if not stat.S_ISREG(info.st_mode):
        raise SnapshotError(f"{name}: is not a regular file, so not a snapshot file")
    return info.st_size


def _check_header(header: bytes, name: str) -> None:
    if len(header) == _HEADER and header[0] == pickle.PROTO[0] and 2 <= header[1] <= 5:
        return
    why = "the file is empty" if not header else (
        f"it starts with {header!r}, not with a pickle's header (0x80 and a protocol from 2 to 5)")
    raise SnapshotError(f"{name}: not a pickle: {why}; {_EXPECTED}")


# ---- unpickling ---------------------------------------------------------------------------------


def _unpickle(reader: PlainReader, name: str) -> Any:
    try:
        return reader.load()
    except Refused as refused:
        raise SnapshotError(
            f"{name}: refused: the pickle names the global {refused} (a class or function). A memory "
            "snapshot holds only dicts, lists, strings and numbers, and loading a global could run "
            "code, so gpumem never loads one"
        ) from None
    except TooLarge as error:
        raise SnapshotError(f"{name}: too large to read: {error} (the opcode at byte {reader.at})") from None
    except BadPickle as error:
        raise SnapshotError(f"{name}: not a pickle: {error} (the opcode at byte {reader.at}); {_EXPECTED}") from None


# ---- shape checks -------------------------------------------------------------------------------


class _Range(NamedTuple):
    low: int
    high: int  # included
    what: str  # what a value in the range is, for messages


_SIZE = _Range(0, MAX_BYTES, "a size in bytes (0 to 2^62)")
_ADDRESS = _Range(0, (1 << 64) - 1, "an address (0 to 2^64 - 1)")
_STREAM = _Range(-(1 << 63), (1 << 64) - 1, "a stream (-2^63 to 2^64 - 1)")
_TIME = _Range(-(1 << 63), (1 << 63) - 1, "a time in microseconds (-2^63 to 2^63 - 1)")
_DEVICE = _Range(0, MAX_DEVICES - 1, f"a device index (0 to {MAX_DEVICES - 1})")
_TOTAL = _Range(1, MAX_BYTES, "a device's memory in bytes (1 to 2^62)")
_LONGEST_NAME = max(len(name) for name in ACTIONS | BLOCK_STATES)


class _Shape:
    """Checks of the snapshot's structure, each raising SnapshotError with the place in the file.

    Every container it walks is claimed once (see the module's docstring on sharing); `budget` caps
    the entries walked, None for none.
    """

    def __init__(self, source: str, budget: Optional[int]):
        self.source = source
        self.budget = budget
        self.walked = 0
        self.claimed: set[int] = set()  # ids of the containers walked; the data keeps them alive

    def fail(self, where: str, what: str) -> SnapshotError:
        return SnapshotError(
            f"{self.source}: not a memory snapshot: {where} {what}; expected what "
            "torch.cuda.memory._dump_snapshot writes"
        )

    def claim(self, value: Any, where: str, entries: int) -> None:
        if id(value) in self.claimed:
            raise self.fail(where, "is the same object as an earlier one; a snapshot from torch never shares them")
        self.claimed.add(id(value))
        self.walked += entries
        if self.budget is not None and self.walked > self.budget:
            raise self.fail(where, f"takes the entries to walk past {self.budget}, more than a file of its size holds")

    def mapping(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"is {describe(value)}, not a dict")
        self.claim(value, where, 1)
        return value

    def require(self, value: dict, where: str, keys: tuple[str, ...]) -> dict:
        missing = [k for k in keys if k not in value]
        if missing:
            raise self.fail(where, f"has no {', '.join(repr(k) for k in missing)}")
        return value

    def sequence(self, value: Any, where: str, most: Optional[int] = None) -> Union[list, tuple]:
        if not isinstance(value, (list, tuple)):
            raise self.fail(where, f"is {describe(value)}, not a list")
        if most is not None and len(value) > most:
            raise self.fail(where, f"has {len(value)} entries, more than {most}")
        self.claim(value, where, len(value))
        return value

    def integer(self, value: Any, where: str, bounds: _Range) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"is {describe(value)}, not an integer")
        if not bounds.low <= value <= bounds.high:
            raise self.fail(where, f"is {describe(value)}, not {bounds.what}")
        return value

    def number(self, entry: dict, at: str, key: str, bounds: _Range, default: Any = None) -> int:
        """entry[key], or `default` where it has none, checked; the place is spelled out only to fail."""
        value = entry.get(key, default)
        if type(value) is int and bounds.low <= value <= bounds.high:
            return value
        return self.integer(value, f"{at}[{key!r}]", bounds)

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise self.fail(where, f"is {describe(value)}, not a string")
        return value

    def name(self, value: Any, where: str, allowed: frozenset) -> str:
        # Type and length first: only then is hashing it for the lookup cheap and safe.
        if not isinstance(value, str) or len(value) > _LONGEST_NAME or value not in allowed:
            raise self.fail(where, f"is {describe(value)}, not one of {', '.join(sorted(allowed))}")
        return value


def _check(shape: _Shape, data: Any) -> Snapshot:
    top = shape.require(shape.mapping(data, "the top level"), "the top level", ("segments", "device_traces"))
    traces, has_times = {}, True
    for device, entries in enumerate(shape.sequence(top["device_traces"], "device_traces", most=MAX_DEVICES)):
        traces[device], timed = _trace(shape, entries, device)
        has_times = has_times and timed
    segments = shape.sequence(top["segments"], "segments")
    settings = top.get("allocator_settings")
    snapshot = Snapshot(
        source=shape.source,
        segments=[_segment(shape, s, i) for i, s in enumerate(segments)],
        traces=traces,
        allocator_settings=settings if isinstance(settings, dict) else {},
        device_totals=_device_totals(shape, top.get(DEVICE_TOTALS_KEY)),
        has_times=has_times,
    )
    if not snapshot.devices():
        raise SnapshotError(f"{shape.source}: the trace is empty: no device has an alloc or free event; {_RECORD_HINT}")
    return snapshot


def _trace(shape: _Shape, entries: Any, device: int) -> tuple[list[Event], bool]:
    """A device's events, and whether each has a time (read here: the raw entries are walked once)."""
    where = f"device_traces[{device}]"
    events, timed = [], True
    for i, entry in enumerate(shape.sequence(entries, where)):
        at = f"{where}[{i}]"
        entry = shape.mapping(entry, at)
        timed = timed and "time_us" in entry
        events.append(_event(shape, entry, i, at))
    return events, timed


def _event(shape: _Shape, entry: dict, index: int, where: str) -> Event:
    action = shape.name(shape.require(entry, where, ("action",))["action"], f"{where}['action']", ACTIONS)
    shape.require(entry, where, ("addr", "size") if action in _ALLOC_OR_FREE else ())
    return Event(
        index=index,
        action=action,
        addr=shape.number(entry, where, "addr", _ADDRESS, 0),
        size=shape.number(entry, where, "size", _SIZE, 0),
        stream=shape.number(entry, where, "stream", _STREAM, 0),
        time_us=shape.number(entry, where, "time_us", _TIME, index),
    )


def _segment(shape: _Shape, entry: Any, index: int) -> Segment:
    where = f"segments[{index}]"
    entry = shape.require(shape.mapping(entry, where), where, ("address", "total_size", "blocks"))
    address = shape.number(entry, where, "address", _ADDRESS)
    return Segment(
        device=shape.number(entry, where, "device", _DEVICE, 0),
        address=address,
        total_size=shape.number(entry, where, "total_size", _SIZE),
        allocated_size=shape.number(entry, where, "allocated_size", _SIZE, 0),
        stream=shape.number(entry, where, "stream", _STREAM, 0),
        segment_type=shape.string(entry.get("segment_type", ""), f"{where}['segment_type']"),
        blocks=_blocks(shape, entry["blocks"], address, f"{where}['blocks']"),
    )


def _blocks(shape: _Shape, entries: Any, address: int, where: str) -> tuple[Block, ...]:
    blocks, offset = [], 0
    for i, block in enumerate(shape.sequence(entries, where)):
        at = f"{where}[{i}]"
        block = shape.require(shape.mapping(block, at), at, ("size", "state"))
        size = shape.number(block, at, "size", _SIZE)
        # Older snapshots leave the address out: blocks tile the segment in address order.
        if "address" not in block and address + offset > _ADDRESS.high:
            raise shape.fail(at, "has no 'address', and the sizes of the blocks before it take its place past "
                                 "2^64 - 1")
        blocks.append(Block(
            address=shape.number(block, at, "address", _ADDRESS, address + offset),
            size=size,
            requested_size=shape.number(block, at, "requested_size", _SIZE, size),
            state=shape.name(block["state"], f"{at}['state']", BLOCK_STATES),
        ))
        offset += size
    return tuple(blocks)


def _device_totals(shape: _Shape, value: Any) -> dict[int, int]:
    if value is None:
        return {}
    if isinstance(value, dict):
        if len(value) > MAX_DEVICES:
            raise shape.fail(DEVICE_TOTALS_KEY, f"has {len(value)} entries, more than {MAX_DEVICES}")
        items = shape.mapping(value, DEVICE_TOTALS_KEY).items()
    else:
        items = enumerate(shape.sequence(value, DEVICE_TOTALS_KEY, most=MAX_DEVICES))
    totals = {}
    for device, total in items:
        device = shape.integer(device, f"a key of {DEVICE_TOTALS_KEY}", _DEVICE)
        totals[device] = shape.integer(total, f"{DEVICE_TOTALS_KEY}[{device}]", _TOTAL)
    return totals


def _has_alloc_or_free(events: list[Event]) -> bool:
    return any(e.action in _ALLOC_OR_FREE for e in events)
