#!/usr/bin/env python3
"""Writes the small synthetic memory snapshots the Python tests read (tests/python/data/).

Each is shaped like what torch.cuda.memory._dump_snapshot writes. A Recorder below plays a simple
allocator (one segment per block, freed segments cached by size and reused) and writes the trace
and the segments at dump time; it also tracks the figures the tests expect, written beside the
snapshots to expected.json:
  peak_allocated  the peak of live blocks, each rounded up to 512 bytes (at least 512), counting
                  blocks alive before the trace began;
  peak_reserved   the peak of the recorder's segments;
  initial_blocks  blocks alive before the trace began.

    python3 tools/make_test_snapshots.py [--out tests/python/data]
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import pickle
import random

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BASE_ADDRESS = 0x7F00_0000_0000
SIDE_STREAM = 0x55D0_0000_1230  # a cudaStream_t as the trace prints it
DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "python" / "data"


def block_size(size: int) -> int:
    return max(512, -(-size // 512) * 512)


def segment_size(size: int) -> int:
    return 2 * MiB if block_size(size) <= MiB else -(-block_size(size) // (2 * MiB)) * (2 * MiB)


class Recorder:
    """One device's trace and segments, with the figures a replay should reproduce."""

    def __init__(self, device: int = 0):
        self.device = device
        self.events: list[dict] = []
        self.time_us = 1_700_000_000_000_000
        self.next_address = BASE_ADDRESS + device * (1 << 40)
        self.blocks: dict[int, dict] = {}  # address -> {size, stream, state}; every segment's one block
        self.segments: dict[int, int] = {}  # address -> segment size
        self.cache: dict[tuple[int, int], list[int]] = collections.defaultdict(list)  # (seg size, stream) -> addresses
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.initial_blocks = 0

    # ---- what a test workload calls -------------------------------------------------------------

    def before_trace(self, size: int, stream: int = 0) -> int:
        """A block (and its segment) that exists before recording starts: no events."""
        self.initial_blocks += 1
        address = self._new_segment(size, stream, record=False)
        self._hold(address, size, stream)
        return address

    def alloc(self, size: int, stream: int = 0) -> int:
        cached = self.cache[(segment_size(size), stream)]
        address = cached.pop() if cached else self._new_segment(size, stream, record=True)
        self._hold(address, size, stream)
        self._event("alloc", address, size, stream)
        return address

    def free(self, address: int, complete: bool = True) -> None:
        block = self.blocks[address]
        self._event("free_requested", address, block["size"], block["stream"])
        block["state"] = "active_pending_free"
        if complete:
            self.complete(address)

    def complete(self, address: int) -> None:
        block = self.blocks.pop(address)
        self._event("free_completed", address, block["size"], block["stream"])
        self.allocated -= block_size(block["size"])
        self.blocks[address] = {"size": 0, "stream": block["stream"], "state": "inactive"}
        self.cache[(self.segments[address], block["stream"])].append(address)

    def empty_cache(self) -> None:
        for (size, stream), addresses in self.cache.items():
            for address in addresses:
                self._event("segment_free", address, size, stream)
                self.reserved -= size
                del self.segments[address], self.blocks[address]
            addresses.clear()

    def oom(self, size: int, stream: int = 0) -> None:
        self.events.append({"action": "oom", "size": size, "stream": stream, "device_free": 0,
                            "time_us": self._tick(), "frames": []})

    # ---- output ---------------------------------------------------------------------------------

    def segment_dicts(self) -> list[dict]:
        return [self._segment_dict(address, size) for address, size in sorted(self.segments.items())]

    def expected(self) -> dict:
        return {"peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved,
                "initial_blocks": self.initial_blocks}

    # ---- the model ------------------------------------------------------------------------------

    def _new_segment(self, size: int, stream: int, record: bool) -> int:
        address, total = self.next_address, segment_size(size)
        self.next_address += total
        self.segments[address] = total
        self.reserved += total
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if record:
            self._event("segment_alloc", address, total, stream)
        return address

    def _hold(self, address: int, size: int, stream: int) -> None:
        self.blocks[address] = {"size": size, "stream": stream, "state": "active_allocated"}
        self.allocated += block_size(size)
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _event(self, action: str, address: int, size: int, stream: int) -> None:
        self.events.append({"action": action, "addr": address, "size": size, "stream": stream,
                            "time_us": self._tick(), "frames": []})

    def _tick(self) -> int:
        self.time_us += 7
        return self.time_us

    def _segment_dict(self, address: int, total: int) -> dict:
        block = self.blocks[address]
        used = block_size(block["size"]) if block["state"] != "inactive" else 0
        blocks = [{"address": address, "size": used, "requested_size": block["size"], "state": block["state"],
                   "frames": []}] if used else []
        if total > used:
            blocks.append({"address": address + used, "size": total - used, "requested_size": 0,
                           "state": "inactive", "frames": []})
        return {"device": self.device, "address": address, "total_size": total,
                "allocated_size": used if block["state"] == "active_allocated" else 0, "active_size": used,
                "requested_size": block["size"], "stream": block["stream"],
                "segment_type": "small" if total == 2 * MiB and used <= MiB else "large",
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}


def snapshot(*recorders: Recorder, device_totals: list[int] | None = None) -> dict:
    traces: list[list[dict]] = [[] for _ in range(max(r.device for r in recorders) + 1)]
    for r in recorders:
        traces[r.device] = r.events
    data = {"segments": [s for r in recorders for s in r.segment_dicts()], "device_traces": traces,
            "allocator_settings": {"expandable_segments": False, "max_split_size": -1}}
    if device_totals is not None:
        data["gpumem_device_totals"] = device_totals
    return data


# ---- the workloads ------------------------------------------------------------------------------


def train_like() -> Recorder:
    """Odd sizes from both pools, a side stream whose frees complete late, the cache emptied once,
    and an OOM the original run survived."""
    rng = random.Random(7)
    r = Recorder()
    params = [r.alloc(rng.choice([3 * MiB + 1000, 12 * MiB + 300, 40_000, 6 * MiB])) for _ in range(12)]
    optimizer_state: list[int] = []
    for step in range(6):
        sequence = rng.choice([1, 2, 3, 5])
        activations = [r.alloc(sequence * rng.randint(200 * KiB, 3 * MiB)) for _ in range(20)]
        small = [r.alloc(rng.randint(1, 8 * KiB)) for _ in range(15)]
        side = [r.alloc(rng.randint(100 * KiB, 2 * MiB), SIDE_STREAM) for _ in range(4)]
        for address in reversed(activations):
            r.free(address)
        grads = [r.alloc(r.blocks[p]["size"]) for p in params]
        if not optimizer_state:
            optimizer_state = [r.alloc(r.blocks[p]["size"]) for p in params for _ in range(2)]
        for address in small + grads:
            r.free(address)
        for address in side:
            r.free(address, complete=False)
        for address in side:
            r.complete(address)
        if step == 3:
            r.oom(64 * GiB)
            r.empty_cache()
    return r


def big_blocks() -> Recorder:
    """Only multiples of 2 MiB of at least 10 MiB: every block is exactly its request, and a limit
    fails exactly at the first request that would take allocated bytes over it."""
    rng = random.Random(11)
    r = Recorder()
    live: list[int] = []
    for _ in range(120):
        if live and rng.random() < 0.45:
            r.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(r.alloc(2 * MiB * rng.randint(5, 40)))
    return r


def preexisting() -> Recorder:
    """Blocks alive before the trace began: (a) still alive at dump, no events; (b) freed in the
    trace, which never allocated them. Sizes are small-pool or multiples of 2 MiB."""
    r = Recorder()
    for size in (24 * MiB, 300 * KiB, 6 * MiB):  # (a)
        r.before_trace(size)
    freed = [r.before_trace(size) for size in (16 * MiB, 100 * KiB, 14 * MiB)]  # (b)
    work = [r.alloc(size) for size in (10 * MiB, 512 * KiB, 4 * MiB)]
    r.free(freed[0])
    r.free(freed[1], complete=False)
    more = [r.alloc(size) for size in (20 * MiB, 12 * KiB)]
    r.complete(freed[1])
    r.free(freed[2])
    for address in work + more:
        r.free(address)
    r.alloc(8 * MiB)
    return r


def two_devices() -> tuple[Recorder, Recorder]:
    """Device 0 recorded nothing but a snapshot marker; device 1 has the work."""
    idle, busy = Recorder(0), Recorder(1)
    idle.events.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 1, "frames": []})
    for size in (12 * MiB, 300 * KiB, 30 * MiB):
        busy.free(busy.alloc(size))
    busy.alloc(2 * MiB)
    return idle, busy


def empty_trace() -> dict:
    """Segments but no alloc or free events: recorded with enabled="state", or recording started late."""
    r = Recorder()
    r.before_trace(4 * MiB)
    r.events.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 5, "frames": []})
    return snapshot(r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    expected: dict[str, dict] = {}

    def write(name: str, data, figures: dict | None = None) -> None:
        path = out / f"{name}.pickle"
        path.write_bytes(pickle.dumps(data, protocol=4))
        if figures is not None:
            expected[name] = figures
        print(f"{path}: {path.stat().st_size} bytes")

    for name, make, totals in (("train_like", train_like, [16 * GiB]), ("big_blocks", big_blocks, None),
                               ("preexisting", preexisting, None)):
        recorder = make()
        write(name, snapshot(recorder, device_totals=totals), recorder.expected())
    idle, busy = two_devices()
    write("two_devices", snapshot(idle, busy), busy.expected())
    write("empty_trace", empty_trace())
    # A pickle naming a global (a harmless one: plain pickle.load would just build an OrderedDict).
    write("with_global", collections.OrderedDict(snapshot(big_blocks())))
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
