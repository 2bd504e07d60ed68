"""Alerts at a share of the cap: `gpumem.on_pressure(share, callback)` and GPUMEM_WARN_AT.

    gpumem.on_pressure(0.85, lambda device, reserved, limit: print("near the cap", device))

The compiled layer counts crossings where reserved memory grows (csrc/core/pressure.h): reserved
reaching `share` of the limit is a crossing, and the watch re-arms only once reserved is back at or
below (share - 0.05) of the limit, so a job hovering at the edge is told once, not once per segment.
Nothing runs inside the allocator (its lock held, no GIL): a daemon thread, started by the first
on_pressure, polls the counters every POLL_SECONDS and calls the callbacks with (device, reserved,
limit), reserved as it was right after the crossing. Crossings of one share on one device between
two polls make one call; the metric gpumem_pressure_crossings_total counts each. A callback that
raises is logged once (logger "gpumem") and keeps being called; the thread goes on.

GPUMEM_WARN_AT=0.85 registers a callback that logs a warning through `logging` (logger "gpumem";
with logging not configured, Python prints it on stderr). `logging` rather than `warnings`: the
warnings filter shows a warning once per place in the code, which would hide the second crossing
the hysteresis is there to let through, and a training job's log handlers see logging records.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

import gpumem._C as _C
from gpumem.settings import sizes
from gpumem.settings.pressure_share import check_share

POLL_SECONDS = 0.1
REARM_GAP = _C.PRESSURE_REARM_GAP  # the compiled layer's figure: one source for both

Callback = Callable[[int, int, int], object]

_log = logging.getLogger("gpumem")


class Watcher:
    """Calls callbacks for the crossings `source` counts: gpumem._C (the process's allocator), or
    anything with its watch_pressure(share) and pressure_crossings(), such as a SimAllocator."""

    def __init__(self, source, poll_seconds: Optional[float] = POLL_SECONDS):
        """`poll_seconds` None: no thread, the caller polls."""
        self._source = source
        self._poll_seconds = poll_seconds
        self._lock = threading.Lock()
        self._callbacks: dict[float, list[Callback]] = {}
        self._seen: dict[tuple[int, float], int] = {}  # (device, share) -> crossings already reported
        self._failed: set[object] = set()  # what already had its error logged: callbacks' ids, "poll"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def add(self, share: float, callback: Callback) -> None:
        """Validates both, then watches `share` on every device and starts the thread; a bad value
        (or a share more than the compiled layer can watch) raises and changes nothing."""
        share = check_share(share)
        if not callable(callback):
            raise TypeError(f"gpumem: pressure callback {_name(callback)} ({type(callback).__name__}) is not "
                            "callable; give a function of (device, reserved, limit)")
        with self._lock:
            self._source.watch_pressure(share)
            self._callbacks.setdefault(share, []).append(callback)
            self._start_locked()

    def poll(self) -> int:
        """Calls the callbacks of the crossings counted since the last poll; returns the calls made."""
        due = []
        with self._lock:
            for device, share, crossings, reserved, limit in self._source.pressure_crossings():
                if crossings <= self._seen.get((device, share), 0):
                    continue
                self._seen[(device, share)] = crossings
                due += [(callback, device, reserved, limit) for callback in self._callbacks.get(share, ())]
        for callback, device, reserved, limit in due:
            self._call(callback, device, reserved, limit)
        return len(due)

    def close(self) -> None:
        """Stops the thread (for tests; the process's watcher runs until the process ends)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def after_fork_in_child(self) -> None:
        """A forked child starts with no callbacks and no thread. fork copies no thread, and most
        forked children (DataLoader workers) never use CUDA: one that does registers its own. The
        parent's thread may have held the locks when the process forked."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._callbacks = {}

    def _start_locked(self) -> None:
        if self._poll_seconds is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._run, name="gpumem-pressure", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_seconds):
            try:
                self.poll()
            except Exception:  # noqa: BLE001: the thread must outlive whatever a poll meets
                self._log_once("poll", "gpumem: polling the pressure counters failed; polling goes on")

    def _call(self, callback: Callback, device: int, reserved: int, limit: int) -> None:
        try:
            callback(device, reserved, limit)
        except Exception:  # noqa: BLE001: a user's callback must not stop the others, nor the thread
            self._log_once(id(callback), f"gpumem: pressure callback {_name(callback)} raised; it is still "
                                         "called at later crossings, and its errors are not logged again")

    def _log_once(self, key: object, message: str) -> None:
        if key not in self._failed:
            self._failed.add(key)
            _log.exception(message)


_process_watcher: Optional[Watcher] = None
_process_lock = threading.Lock()


def on_pressure(share: float, callback: Callback) -> None:
    """Calls `callback(device, reserved, limit)` each time reserved memory on a device passes `share`
    of its limit, from a gpumem thread, soon after (within about POLL_SECONDS).

    `share` is in (0, 1]. After a call the share re-arms only once reserved has fallen to
    (share - 0.05) of the limit or below. Applies to every device, those not used yet included;
    a device already past a share when it is first watched is reported at once. Starts no CUDA. Callbacks stay registered
    for the life of the process; at most MAX_PRESSURE_SHARES different shares can be watched.
    A bad share or a callback that is not callable raises and changes nothing.
    """
    _watcher().add(share, callback)


def warn_at(share: float) -> None:
    """A warning through logging (logger "gpumem") at each crossing of `share`: GPUMEM_WARN_AT."""
    low = max(share - REARM_GAP, 0.0)

    def warn(device: int, reserved: int, limit: int) -> None:
        _log.warning("gpumem: device %d has %s reserved, %s of its limit of %s (GPUMEM_WARN_AT=%g); the next "
                     "warning comes after reserved has fallen to %.0f%% of the limit or below",
                     device, sizes.format_bytes(reserved), _percent(reserved, limit), sizes.format_bytes(limit),
                     share, 100 * low)

    on_pressure(share, warn)


def _name(callback: object) -> str:
    name = getattr(callback, "__qualname__", None) or repr(callback)
    return name if len(name) <= 80 else "..." + name[-80:]  # the end: the function itself


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "all"


def _watcher() -> Watcher:
    global _process_watcher
    with _process_lock:
        if _process_watcher is None:
            _process_watcher = Watcher(_C, POLL_SECONDS)
        return _process_watcher


def _after_fork_in_child() -> None:
    global _process_lock
    _process_lock = threading.Lock()
    if _process_watcher is not None:
        _process_watcher.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
