"""A cheap recorder of (seconds, allocated, reserved) per device, for a live process. Off unless
started.

    gpumem.timeline.start()          # a daemon thread reads gpumem's statistics every 10 ms
    ...                              # the work
    gpumem.timeline.stop()
    gpumem.report().plot("memory.png")

It stays bounded: once a device holds `max_points` points, every other one is dropped and the
thread samples half as often, so a long run keeps its whole history at a coarser step.
"""
from __future__ import annotations

import threading
import time
from typing import Iterable, Optional

from gpumem import _C

_lock = threading.Lock()
_recorder: Optional["_Recorder"] = None


class _Recorder:
    def __init__(self, devices: list[int], interval_s: float, max_points: int):
        self.devices = devices
        self.interval_s = interval_s
        self.max_points = max_points
        self.every = 1  # sample every n-th tick; doubles each time the points are thinned
        self.points: dict[int, list[tuple[float, int, int]]] = {d: [] for d in devices}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gpumem-timeline", daemon=True)

    def _run(self) -> None:
        start, tick = time.monotonic(), 0
        while True:
            if tick % self.every == 0:
                self._sample(time.monotonic() - start)
            tick += 1
            if self.stopped.wait(self.interval_s):
                return

    def _sample(self, seconds: float) -> None:
        samples = [(d, _C.stats(d)) for d in self.devices]
        with _lock:
            for d, stats in samples:
                self.points[d].append((seconds, stats["allocated_bytes.all.current"],
                                       stats["reserved_bytes.all.current"]))
            if len(self.points[self.devices[0]]) >= self.max_points:
                for points in self.points.values():
                    del points[1::2]
                self.every *= 2


def start(interval_s: float = 0.01, max_points: int = 10000, devices: Optional[Iterable[int]] = None) -> None:
    """Starts sampling every visible device (or `devices`) every `interval_s` seconds."""
    global _recorder
    if interval_s <= 0 or max_points < 2:
        raise ValueError(f"gpumem: timeline needs interval_s > 0 and max_points >= 2 (got {interval_s}, {max_points})")
    indices = list(range(_C.device_count()) if devices is None else devices)
    if not indices:
        raise RuntimeError("gpumem: no CUDA device is visible, so there is nothing to record")
    with _lock:
        if _recorder is not None and _recorder.thread.is_alive():
            raise RuntimeError("gpumem: the timeline is already recording; call gpumem.timeline.stop() first")
        _recorder = _Recorder(indices, interval_s, max_points)
    _recorder.thread.start()


def stop() -> None:
    """Stops sampling; the points stay readable until the next start()."""
    recorder = _recorder
    if recorder is not None:
        recorder.stopped.set()
        recorder.thread.join()


def is_recording() -> bool:
    recorder = _recorder
    return recorder is not None and recorder.thread.is_alive()


def points(device: int = 0) -> list[tuple[float, int, int]]:
    """The (seconds since start, allocated, reserved) points of `device`; [] if none were taken."""
    with _lock:
        return list(_recorder.points.get(device, [])) if _recorder is not None else []
