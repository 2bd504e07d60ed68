"""A cheap recorder of (seconds, allocated, reserved) per device, for a live process. Off unless
started.

    gpumem.timeline.start()          # a daemon thread reads gpumem's statistics every 10 ms
    ...                              # the work
    gpumem.timeline.stop()
    gpumem.report().plot("memory.png")

It stays bounded: once a device holds `max_points` points, every other one is dropped and the
thread samples half as often, so a long run keeps its whole history at a coarser step. If reading
the statistics fails, the thread stops there, keeping the points it has; `error()` says why, and
stop() warns with it.
"""
from __future__ import annotations

import math
import numbers
import threading
import time
import warnings
from typing import Iterable, Optional

import gpumem._C as _C
from gpumem.settings import devices as _devices
from gpumem.settings.echo import bounded, shown

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
        self.error: Optional[str] = None
        self.thread = threading.Thread(target=self._run, name="gpumem-timeline", daemon=True)

    def _run(self) -> None:
        try:
            self._record()
        except Exception as error:  # noqa: BLE001: a daemon thread's traceback would reach nobody who can act on it
            self.error = f"{type(error).__name__}: {bounded(str(error))}"

    def _record(self) -> None:
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
    """Starts sampling every visible device (or `devices`: indices, "cuda:N" or torch.device) every
    `interval_s` seconds. A bad argument raises ValueError or TypeError naming it (a device that
    does not exist, the ones there are); no CUDA device at all, RuntimeError. Starts no CUDA."""
    global _recorder
    _check_settings(interval_s, max_points)
    indices = _indices(devices)
    with _lock:
        if _recorder is not None and _recorder.thread.is_alive():
            raise RuntimeError("gpumem: the timeline is already recording; call gpumem.timeline.stop() first")
        _recorder = _Recorder(indices, interval_s, max_points)
    _recorder.thread.start()


def stop() -> None:
    """Stops sampling; the points stay readable until the next start(). Warns (RuntimeWarning) if
    the recording had stopped early on an error."""
    recorder = _recorder
    if recorder is None:
        return
    recorder.stopped.set()
    recorder.thread.join()
    if recorder.error is not None:
        warnings.warn(f"gpumem: the timeline stopped recording early: {recorder.error}", RuntimeWarning, stacklevel=2)


def error() -> Optional[str]:
    """Why the recording stopped early ("TypeName: message"), or None if it did not."""
    recorder = _recorder
    return None if recorder is None else recorder.error


def is_recording() -> bool:
    recorder = _recorder
    return recorder is not None and recorder.thread.is_alive()


def points(device: int = 0) -> list[tuple[float, int, int]]:
    """The (seconds since start, allocated, reserved) points of `device`; [] if none were taken."""
    with _lock:
        return list(_recorder.points.get(device, [])) if _recorder is not None else []


def _check_settings(interval_s: object, max_points: object) -> None:
    if isinstance(interval_s, bool) or not isinstance(interval_s, numbers.Real):
        raise TypeError(f"gpumem: timeline interval_s {shown(interval_s)} is not a number of seconds")
    if isinstance(max_points, bool) or not isinstance(max_points, numbers.Integral):
        raise TypeError(f"gpumem: timeline max_points {shown(max_points)} is not an int")
    if not (interval_s > 0 and math.isfinite(interval_s)) or max_points < 2:
        raise ValueError(f"gpumem: timeline needs interval_s > 0 and max_points >= 2 "
                         f"(got {shown(interval_s)}, {shown(max_points)})")


def _indices(devices: Optional[Iterable[int]]) -> list[int]:
    """The devices to sample, each checked (as every gpumem call checks one, without starting CUDA)."""
    if devices is None:
        return _devices.every()
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise TypeError(f"gpumem: timeline devices {shown(devices)} is not a list of devices "
                        "(indices, 'cuda:N' or torch.device)")
    indices = list(dict.fromkeys(_devices.index(device) for device in devices))
    if not indices:
        raise ValueError("gpumem: timeline devices is empty; give at least one, or None for every device")
    return indices
