"""Replaying a recorded memory trace under a gpumem limit, on a simulated device (no GPU).

A snapshot from torch.cuda.memory._dump_snapshot lists every alloc and free the job made. Fed to
gpumem's allocator over a simulated device (`_C.SimAllocator`), it answers "would this run fit
under 4 GB?" and, by bisection, "what is the smallest limit it fits under?".

Note [what is replayed]
  - An `alloc` event allocates its `size` on its stream (stream ids become small integers).
  - `free_completed` frees the block. Where the device's trace has no `free_completed` for an
    address (recorded with skip_actions, say), `free_requested` does, unless the block was still
    pending at dump time: then the memory was never given back during the trace.
  - Blocks alive before the trace began hold memory from its start: (a) blocks the segments list
    as active at dump time whose address has no alloc or free in the trace, and (b) blocks the
    trace frees without having allocated them. They are allocated first, in address order.
  - The replay stops at the first request gpumem refuses and reports it.

Note [peak allocated]
  gpumem counts allocated bytes per block, as PyTorch does: a request becomes a block of
  round_up(size, 512) bytes, at least 512. `peak_allocated_from_trace` computes the peak with that
  rounding straight from the trace, and a replay's "allocated_bytes.all.peak" equals it exactly
  whenever every block is its rounded request. A block can be larger only when a large-pool block
  keeps a remainder of 1 MiB or less rather than splitting it (as in PyTorch), so the replay's peak
  is never below the trace's and exceeds it by at most 1 MiB per such block alive at the peak.

Note [segments]
  A replay uses the segment kind asked for, "growable" by default as on a GPU whose driver has
  CUDA virtual memory management: the simulated device then maps pages of PAGE_SIZE (2 MiB, the
  granularity of current NVIDIA GPUs) into reserved address ranges. "plain" replays with one
  simulated cudaMalloc per segment, as on a device without it or under
  gpumem.set_segments("plain"). Growable segments fragment less, so a trace usually fits under
  a lower limit with them; the original run's figures are whatever its allocator used.
  Replayed with plain segments, a run PyTorch recorded with plain segments gets its blocks split
  as PyTorch split them, and so PyTorch's peak allocated exactly; growable segments place blocks
  differently, and their peak differs from it by unsplit remainders (see Note [peak allocated]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import gpumem._C as _C
from gpumem.settings import limits, segments as _segments, sizes as _sizes
from gpumem.settings.chunk import chunk_bytes
from gpumem.settings.echo import shown
from gpumem.trace.snapshot_file import Segment, Snapshot, Source, load

MiB = 1 << 20
PAGE_SIZE = 2 * MiB  # the simulated device's mapping granularity for growable segments
MAX_TIMELINE_POINTS = 5000

Limit = Union[str, int, None]

_ALLOC, _FREE = 0, 1
# Large enough for any real device; percentages of it are never mistaken for byte counts.
_HUGE_TOTALS = (1 << 62, 1 << 61)


def block_size(size: int) -> int:
    """The block a request of `size` bytes takes, by the allocator's own rule (_C.block_size)."""
    return _C.block_size(size)


@dataclass(frozen=True)
class Failure:
    """The first request gpumem refused. `event_index` is None for a block alive before the trace."""

    event_index: Optional[int]
    time_us: Optional[int]
    size: int
    kind: str  # "over the limit", "device full" or "fragmentation"
    message: str


@dataclass
class ReplayResult:
    device: int
    limit: int
    capacity: int
    capacity_source: str  # "snapshot", "given" or "trace"
    segments: str  # "growable" or "plain": see Note [segments]
    fits: bool
    failure: Optional[Failure]
    peak_allocated: int
    peak_reserved: int
    original_peak_reserved: int
    original_reserved_source: str  # "trace" (segment events) or "dump" (segments at dump time)
    inactive_split_peak: int
    largest_free_block: int
    events_total: int
    allocs_replayed: int
    frees_replayed: int
    initial_blocks: int
    original_ooms: int
    stats: dict = field(repr=False, default_factory=dict)
    timeline: list[tuple[int, int, int]] = field(repr=False, default_factory=list)  # (time_us, allocated, reserved)

    def report(self):
        """This replay as a gpumem Report: its end state, peaks and timeline."""
        from gpumem.monitoring.reporting import Report

        origin = self.timeline[0][0] if self.timeline else 0
        return Report.from_stats({self.device: {
            "stats": self.stats,
            "limit": self.limit,
            "total": self.capacity,
            "free": self.capacity - self.stats.get("reserved_bytes.all.current", 0),
            "largest_free_block": self.largest_free_block,
            "timeline": [((t - origin) / 1e6, a, r) for t, a, r in self.timeline],
            "simulated": True,
            "segments": self.segments,
        }}, title="gpumem replay on the simulated device")


@dataclass(frozen=True)
class MinLimit:
    """The smallest limit, to `precision` bytes, under which the trace replays without a failure.

    `limit` is None when the trace does not fit even in the whole simulated device.
    """

    limit: Optional[int]
    peak_allocated: int
    ratio: Optional[float]  # limit / peak_allocated
    precision: int
    capacity: int
    replays: int
    segments: str = _segments.GROWABLE


def replay(snapshot: Union[Snapshot, Source], limit: Limit, device: Optional[int] = None,
           total: Optional[int] = None, segments: str = _segments.GROWABLE, chunk: Union[int, str] = 0) -> ReplayResult:
    """Replays `device`'s trace (the first device with events for None) under `limit`.

    `limit` is a spec ("4GB", "50%", "none") or a byte count. The simulated device has `total`
    bytes if given, else the device total the snapshot records, else max(limit, 2 × the peak the
    trace needs); a percentage or fraction is of that size. `segments` is "growable" or "plain"
    (see Note [segments]); `chunk` the least chunk of growable segments' large pool, as
    GPUMEM_CHUNK takes it (0, pages, by default; gpumem.settings.chunk).
    """
    growable = _segments.growable(segments)
    least = chunk_bytes(chunk)
    plan = _Plan.of(_loaded(snapshot), device)
    capacity, source = _capacity(plan, limit, total)
    return _run(plan, _Device(capacity, source, growable, plan.device, least), _limit_bytes(limit, capacity),
                timeline=True)


def peak_allocated_from_trace(snapshot: Union[Snapshot, Source], device: Optional[int] = None) -> int:
    """The peak of the sum of live blocks (each request rounded as gpumem rounds it), straight from
    the trace, counting the blocks alive before it began. See Note [peak allocated]."""
    return _Plan.of(_loaded(snapshot), device).peak_allocated


def min_limit(snapshot: Union[Snapshot, Source], precision: int = MiB, device: Optional[int] = None,
              total: Optional[int] = None, segments: str = _segments.GROWABLE, chunk: Union[int, str] = 0) -> MinLimit:
    """Bisects limits on the grid peak_allocated + k × precision, up to the simulated device's size.

    The result fits, and the grid point below it (`precision` bytes lower) fails. Fitting is not
    monotone in the limit: a different limit changes which cached segments are released and so
    how memory fragments (seen on real traces: a job fit at 605 MiB, failed at 636 MiB and fit at
    637 MiB). So the result is a limit that fits with the one right below it failing, which the
    bisection finds in log2(steps) replays; a smaller limit may fit too. `precision` is rounded up
    to a multiple of 512 bytes; `peak_allocated` is the trace's (see Note [peak allocated]).
    `segments` is "growable" or "plain" (see Note [segments]); `chunk` as for replay().
    """
    if isinstance(precision, bool) or not isinstance(precision, int):
        raise TypeError(f"gpumem: precision {shown(precision)} is not an int number of bytes")
    if not 0 < precision <= _C.SIM_MAX_CAPACITY:
        raise ValueError(f"gpumem: precision {shown(precision)} is not a number of bytes from 1 to the largest "
                         f"simulated device's {_C.SIM_MAX_CAPACITY}")
    precision = block_size(precision)
    growable = _segments.growable(segments)
    least = chunk_bytes(chunk)
    plan = _Plan.of(_loaded(snapshot), device)
    capacity, source = _capacity(plan, None, total)
    sim_device = _Device(capacity, source, growable, plan.device, least)
    kind = _segments.kind(growable)
    floor = plan.peak_allocated
    steps = max(0, math.ceil((capacity - floor) / precision))

    def candidate(k: int) -> int:
        return min(floor + k * precision, capacity)

    def fits(k: int) -> bool:
        return _run(plan, sim_device, candidate(k), timeline=False).fits

    if floor > capacity:
        return MinLimit(None, floor, None, precision, capacity, replays=0, segments=kind)
    if not fits(steps):
        return MinLimit(None, floor, None, precision, capacity, replays=1, segments=kind)
    low, high, replays = -1, steps, 1  # below the peak every limit fails; the top fits
    while high - low > 1:
        middle = (low + high) // 2
        replays += 1
        if fits(middle):
            high = middle
        else:
            low = middle
    found = candidate(high)
    return MinLimit(found, floor, found / floor if floor else None, precision, capacity, replays, kind)


# ---- the plan: the trace as allocs and frees of numbered blocks --------------------------------


@dataclass
class _Plan:
    device: int
    initial: list[tuple[int, int, int]]  # (address, size, stream), blocks alive before the trace
    ops: list[tuple[int, int, int, int, int, int]]  # (_ALLOC/_FREE, block, size, stream, event index, time_us)
    events_total: int
    peak_allocated: int
    original_peak_reserved: int
    original_reserved_source: str
    original_ooms: int
    device_total: Optional[int]

    @staticmethod
    def of(snapshot: Snapshot, device: Optional[int]) -> "_Plan":
        if device is None:
            device = snapshot.devices()[0]
        events = snapshot.events(device)
        segments = snapshot.segments_of(device)
        initial, ops = _Pairing(events, segments).result()
        reserved, reserved_source = _original_peak_reserved(events, segments)
        return _Plan(
            device=device,
            initial=initial,
            ops=ops,
            events_total=len(events),
            peak_allocated=_peak_of(initial, ops),
            original_peak_reserved=reserved,
            original_reserved_source=reserved_source,
            original_ooms=sum(1 for e in events if e.action == "oom"),
            device_total=snapshot.device_totals.get(device),
        )


class _Pairing:
    """Turns trace events into allocs and frees of numbered blocks: see Note [what is replayed]."""

    def __init__(self, events, segments: list[Segment]):
        self.events = events
        self.segments = segments
        self.completes = {e.addr for e in events if e.action == "free_completed"}
        self.pending_at_dump = {b.address for s in segments for b in s.blocks if b.state == "active_pending_free"}
        self.streams: dict[int, int] = {0: 0}
        self.live: dict[int, int] = {}  # address -> block number
        self.seen: set[int] = set()  # addresses with an alloc or free in the trace
        self.before: list[tuple[int, int, int, int]] = []  # (address, block, size, stream)
        self.ops: list[tuple[int, int, int, int, int, int]] = []

    def result(self):
        for event in self.events:
            if event.action == "alloc":
                self._alloc(event)
            elif event.action in ("free_requested", "free_completed"):
                self._free(event)
        self._alive_at_dump()
        # Blocks alive before the trace are numbered 0.. in address order, the order they are made.
        self.before.sort()
        renumber = {block: n for n, (_, block, _, _) in enumerate(self.before)}
        shift = len(self.before)
        ops = [(op, renumber[b] if b < 0 else b + shift, size, stream, index, time)
               for op, b, size, stream, index, time in self.ops]
        return [(a, size, stream) for a, _, size, stream in self.before], ops

    def _stream(self, stream: int) -> int:
        return self.streams.setdefault(stream, len(self.streams))

    def _alloc(self, event) -> None:
        if event.addr in self.live:  # a free the trace lost; the address is in use again
            self._emit(_FREE, self.live.pop(event.addr), event)
        self.seen.add(event.addr)
        block = len(self.ops)
        self.live[event.addr] = block
        self._emit(_ALLOC, block, event)

    def _free(self, event) -> None:
        frees = event.action == "free_completed" or (
            event.addr not in self.completes and event.addr not in self.pending_at_dump)
        if event.addr not in self.seen:
            self._alive_before(event.addr, event.size, event.stream)
        self.seen.add(event.addr)
        if frees and event.addr in self.live:
            self._emit(_FREE, self.live.pop(event.addr), event)

    def _alive_at_dump(self) -> None:
        for segment in self.segments:
            for block in segment.blocks:
                if block.active and block.address not in self.seen:
                    self._alive_before(block.address, block.requested_size or block.size, segment.stream)

    def _alive_before(self, address: int, size: int, stream: int) -> None:
        block = -1 - len(self.before)  # negative until renumbered in address order
        self.before.append((address, block, size, self._stream(stream)))
        self.live[address] = block

    def _emit(self, op: int, block: int, event) -> None:
        self.ops.append((op, block, event.size, self._stream(event.stream), event.index, event.time_us))


def _peak_of(initial, ops) -> int:
    sizes: dict[int, int] = {}
    current = sum(block_size(size) for _, size, _ in initial)
    for n, (_, size, _) in enumerate(initial):
        sizes[n] = block_size(size)
    peak = current
    for op, block, size, _, _, _ in ops:
        if op == _ALLOC:
            sizes[block] = block_size(size)
            current += sizes[block]
            peak = max(peak, current)
        else:
            current -= sizes.pop(block)
    return peak


def _original_peak_reserved(events, segments: list[Segment]) -> tuple[int, str]:
    at_dump = sum(s.total_size for s in segments)
    change, highest, any_segment_event = 0, 0, False
    for e in events:
        if e.action in ("segment_alloc", "segment_map"):
            change += e.size
        elif e.action in ("segment_free", "segment_unmap"):
            change -= e.size
        else:
            continue
        any_segment_event = True
        highest = max(highest, change)
    if not any_segment_event:
        return at_dump, "dump"
    # What was reserved when the trace began is what the dump holds minus what the trace added.
    return max(0, at_dump - change) + highest, "trace"


# ---- running a plan -----------------------------------------------------------------------------


def _loaded(snapshot: Union[Snapshot, Source]) -> Snapshot:
    return snapshot if isinstance(snapshot, Snapshot) else load(snapshot)


def _limit_bytes(limit: Limit, capacity: int) -> int:
    nbytes = limits.parse(_spec(limit), capacity)
    return capacity if nbytes is None else nbytes


def _spec(limit: Limit) -> str:
    if limit is None:
        return "none"
    if isinstance(limit, bool) or not isinstance(limit, (int, str)):
        raise TypeError(
            f"gpumem: limit {shown(limit)} is not a spec string or a byte count. Accepted forms: {_C.limit_forms}")
    return str(limit)


def _capacity(plan: _Plan, limit: Limit, total: Optional[int]) -> tuple[int, str]:
    if total is not None:
        return _modelled(total, "the given device total"), "given"
    if plan.device_total is not None:
        return _modelled(plan.device_total, f"the snapshot's total for device {plan.device}"), "snapshot"
    need = 2 * max(plan.peak_allocated, plan.original_peak_reserved)
    need = -(-need // (2 * MiB)) * (2 * MiB)  # whole large segments
    capacity = max(need, _absolute_bytes(limit) or 0, 2 * MiB)
    # Each size in a snapshot is at most 2^62 bytes, but what they add up to is not bounded.
    return _modelled(capacity, "the device the trace needs (twice its peak)",
                     "; give the device's real size (total=, gpumem replay --device-total)"), "trace"


def _modelled(total: int, what: str, advice: str = "") -> int:
    """`total` if the simulated device can be that large; ValueError naming `what` if not."""
    if isinstance(total, bool) or not isinstance(total, int) or not 0 < total <= _C.SIM_MAX_CAPACITY:
        size = _sizes.format_bytes(total) if isinstance(total, int) and total > 0 else shown(total)
        raise ValueError(f"gpumem: {what} ({size}) is not a device size the simulator models: "
                         f"1 byte to {_sizes.format_bytes(_C.SIM_MAX_CAPACITY)} ({_C.SIM_MAX_CAPACITY} bytes){advice}")
    return total


def _absolute_bytes(limit: Limit) -> Optional[int]:
    """The limit in bytes when it does not depend on the device's size (not "50%" or "0.5")."""
    spec = _spec(limit)
    sizes = {limits.parse(spec, total) for total in _HUGE_TOTALS}
    return sizes.pop() if len(sizes) == 1 else None


@dataclass(frozen=True)
class _Device:
    """The simulated device a plan runs on. It has the trace's device index (devices before it are
    never made), so that messages name the device the trace was recorded on."""

    capacity: int
    capacity_source: str
    growable: bool
    index: int = 0
    chunk: int = 0  # the large pool's least chunk (growable segments)

    def allocator(self):
        sim = _C.SimAllocator(self.capacity, self.index + 1, page_size=PAGE_SIZE if self.growable else 0)
        if self.growable and self.chunk:
            sim.set_large_chunk(self.index, self.chunk)
        return sim


def _run(plan: _Plan, sim_device: _Device, limit: int, timeline: bool) -> ReplayResult:
    sim = sim_device.allocator()
    d = sim_device.index
    sim.set_limit_bytes(d, limit)
    walk = _Walk(sim, plan, timeline)
    walk.run()
    stats = sim.stats(d)
    return ReplayResult(
        device=plan.device,
        limit=limit,
        capacity=sim_device.capacity,
        capacity_source=sim_device.capacity_source,
        segments=_segments.kind(sim_device.growable),
        fits=walk.failure is None,
        failure=walk.failure,
        peak_allocated=stats["allocated_bytes.all.peak"],
        peak_reserved=sim.ledger(d)["peak"],
        original_peak_reserved=plan.original_peak_reserved,
        original_reserved_source=plan.original_reserved_source,
        inactive_split_peak=stats["inactive_split_bytes.all.peak"],
        largest_free_block=sim.largest_free_block(d),
        events_total=plan.events_total,
        allocs_replayed=walk.allocs,
        frees_replayed=walk.frees,
        initial_blocks=len(plan.initial),
        original_ooms=plan.original_ooms,
        stats=stats,
        timeline=walk.points,
    )


class _Walk:
    """One pass of a plan through a simulated allocator, up to the first failure."""

    def __init__(self, sim, plan: _Plan, timeline: bool):
        self.sim = sim
        self.plan = plan
        self.address: dict[int, int] = {}  # block number -> address in the simulated device
        self.failure: Optional[Failure] = None
        self.allocs = self.frees = 0
        self.points: list[tuple[int, int, int]] = []
        # Sample every stride-th operation, so that the timeline stays within MAX_TIMELINE_POINTS.
        self.stride = max(1, math.ceil(len(plan.ops) / MAX_TIMELINE_POINTS)) if timeline and plan.ops else 0

    def run(self) -> None:
        for n, (_, size, stream) in enumerate(self.plan.initial):
            if not self._alloc(n, size, stream, None, None):
                return
        self._sample(self.plan.ops[0][5] if self.plan.ops else 0)  # the blocks alive before the trace
        last = len(self.plan.ops) - 1
        for n, (op, block, size, stream, index, time) in enumerate(self.plan.ops):
            if op == _FREE:
                self.sim.free(self.address.pop(block))
                self.frees += 1
            elif not self._alloc(block, size, stream, index, time):
                self._sample(time)
                return
            if self.stride and (n % self.stride == 0 or n == last):
                self._sample(time)

    def _alloc(self, block: int, size: int, stream: int, index: Optional[int], time: Optional[int]) -> bool:
        try:
            self.address[block] = self.sim.malloc(self.plan.device, size, stream)
        except _C.OutOfMemoryError as error:
            self.failure = _failure(index, time, size, error)
            return False
        if index is not None:  # an event of the trace, not a block alive before it
            self.allocs += 1
        return True

    def _sample(self, time: int) -> None:
        if self.stride:
            d = self.plan.device
            self.points.append((time, self.sim.stats(d)["allocated_bytes.all.current"], self.sim.reserved(d)))


def _failure(index: Optional[int], time: Optional[int], size: int, error: Exception) -> Failure:
    return Failure(index, time, size, error.case, str(error))

