"""Each gpumem process's figures in a small file, for `gpumem top` (gpumem.monitoring.top) to read: the
writer. What a file holds, and reading it back, are gpumem.monitoring.published's.

    /tmp/gpumem-1000/4242-9f3a61c0b27de845.json

Where. The run directory: GPUMEM_RUN_DIR, else /tmp/gpumem-<uid>, made 0700 by the first process
that publishes. /tmp because it is there in every process (batch jobs, services and containers
have no XDG_RUNTIME_DIR, and /run/user/<uid> goes at logout, with a job still running), and one
pattern lets `gpumem top`, run as root, find every user's directory. Not $TMPDIR, which schedulers
set per job: the jobs would not see each other. Whether a directory is trusted is
published.run_dir_problem's (Note [trusting a run directory] there): the default one must be this
user's own and private, so no one else can plant or read the files; a GPUMEM_RUN_DIR is used as it
is (an administrator may share one with containers), unless users besides its owner may write to
it and it is not sticky. It is made 0700 if missing. Files are 0600, under a name with a random
part that nobody can take first (Note [names nobody can take first] there).

When. A daemon thread, `gpumem-publish`, started when the process first initializes CUDA (as the
metrics endpoint, gpumem.monitoring.startup: a launcher or a DataLoader worker publishes nothing), wakes
every PUBLISH_SECONDS, reads the figures of the devices in use (existing_devices, stats and
get_limit: one copy of the statistics per device, the allocator's lock held for the copy only, no
CUDA call), and rewrites the file only when a figure changed: written to a temporary file in the
directory, then renamed over the old one, so a reader sees the old figures or the new, never half.
The file appears once a device has held memory. Every HEARTBEAT_SECONDS without a change the file's
time is touched (and the file written again if someone removed it): how a reader that cannot look
the process up (another pid namespace) tells a live one from one that was killed.

Stale files. The process removes its file at exit (atexit; a forked child leaves its parent's
alone). A process killed outright leaves it behind: `gpumem top` removes it once the pid is gone or
has another start time (Note [pid reuse] in gpumem.monitoring.proc), or, for a process it cannot look up,
once the file has not been touched for STALE_SECONDS.

Errors. Publishing never stops the program: what goes wrong (the directory refused, a full disk)
is one line on stderr, the file is removed, and the process goes on without publishing.
GPUMEM_PUBLISH=0 turns it off.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

import gpumem._C as _C
from gpumem.monitoring import figures as _figures, metrics, proc, published
from gpumem.settings.echo import relayed, shown_path
# What a file holds and where it goes, the reader's to check as much as the writer's, are defined there.
from gpumem.monitoring.published import FORMAT, NAME_RANDOM_DIGITS, PUBLISH, file_name
from gpumem.settings.run_dir import RunDir

PUBLISH_SECONDS = 1.0
HEARTBEAT_SECONDS = 10.0
TURN_OFF = "GPUMEM_PUBLISH=0 turns publishing off"


def prepare(run_dir: RunDir, use: str = PUBLISH) -> None:
    """Makes the directory (0700) if it is missing; PermissionError saying why if it cannot be
    trusted for `use` (published.PUBLISH, or SHARE for a sharing table), OSError if it cannot be
    made."""
    if run_dir.chosen:
        os.makedirs(run_dir.path, 0o700, exist_ok=True)
    else:
        with contextlib.suppress(FileExistsError):
            os.mkdir(run_dir.path, 0o700)
    problem = published.run_dir_problem(run_dir, use)
    if problem is not None:
        raise PermissionError(f"{shown_path(run_dir.path)} {problem}")


# ---- writing --------------------------------------------------------------------------------------


def own_identity(job: Optional[str] = None) -> dict:
    """What names this process in its file: pid, start time, pid namespace and job."""
    pid = os.getpid()
    started = proc.start_time(pid)
    if started is None:
        raise OSError(f"/proc/{pid}/stat cannot be read, and without the start time a reused pid would pass "
                      "for this process")
    return {"pid": pid, "start_time": started, "pid_namespace": proc.pid_namespace(pid),
            "job": metrics.job_name() if job is None else job}


def device_figures(source, fixed: Callable[[int], dict]) -> list[dict]:
    """The figures of each device in use that has held memory or refused some, as the file holds
    them (gpumem.monitoring.figures.PUBLISHED); `fixed(device)`: what does not change (uuid, device_total)."""
    devices = []
    for device in source.existing_devices():
        figures = source.device_figures(device, device_memory=False)  # no CUDA call
        stats = figures["stats"]
        if figures["reserved"] == 0 and stats["reserved_bytes.all.peak"] == 0 and stats["num_ooms"] == 0:
            continue  # made by a setting (set_limit on it), never used
        entry = {"index": device, **fixed(device)}
        entry.update({figure.key: _figures.published_value(figure, figures) for figure in _figures.PUBLISHED})
        entry["scope"] = figures["scope"]
        entry["sharing"] = figures.get("sharing") is not None
        devices.append(entry)
    return devices


class Publisher:
    """Keeps <run dir>/<pid>-<random>.json up to date with one process's figures (see the module's
    docstring).

    `source`: gpumem._C (the process's allocator) by default, or anything with its existing_devices()
    and device_figures(device, device_memory), such as a SimAllocator.
    `identity`: own_identity() by default.
    `uuid_of(device)`: the device's UUID, or None. `clock`: seconds, for the heartbeat.
    """

    def __init__(self, run_dir: RunDir, source=None, identity: Optional[dict] = None,
                 uuid_of: Optional[Callable[[int], Optional[str]]] = None, interval: float = PUBLISH_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.run_dir = run_dir
        self.identity = own_identity() if identity is None else identity
        random_part = secrets.token_hex(NAME_RANDOM_DIGITS // 2)
        self.path = os.path.join(run_dir.path, file_name(self.identity["pid"], random_part))
        self.owner = os.getpid()  # a forked child neither writes nor removes its parent's file
        self._source = _C if source is None else source
        self._uuid_of = _torch_uuid if uuid_of is None else uuid_of
        self._fixed: dict[int, dict] = {}
        self._interval, self._clock = interval, clock
        self._written: Optional[list] = None
        self._touched = 0.0
        self._lock = threading.Lock()  # a write against stop(): no file after stop
        self._stopped = False
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpumem-publish", daemon=True)
        self._thread.start()

    def step(self) -> bool:
        """One wake: writes the file if a figure changed, touches it if a heartbeat is due. Never
        raises: False once publishing has stopped (after an error: one line on stderr)."""
        if self._stopped:
            return False
        try:
            self._publish()
        except Exception as error:  # noqa: BLE001: publishing must never stop the program
            self._fail(error)
        return not self._stopped

    def stop(self) -> None:
        """Stops publishing and removes the file (at exit; a no-op in a forked child)."""
        if os.getpid() != self.owner:
            return
        self._stopping.set()
        with self._lock:
            self._stopped = True
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _run(self) -> None:
        while self.step() and not self._stopping.wait(self._interval):
            pass

    def _publish(self) -> None:
        devices = device_figures(self._source, self._fixed_of)
        with self._lock:
            if self._stopped or os.getpid() != self.owner:
                return
            now = self._clock()
            if devices != self._written and (devices or self._written is not None):
                self._write({"format": FORMAT, **self.identity, "devices": devices})
                self._written, self._touched = devices, now
            elif self._written is not None and now - self._touched >= HEARTBEAT_SECONDS:
                self._touch()
                self._touched = now

    def _write(self, payload: dict) -> None:
        try:
            write_atomically(self.path, payload)
        except FileNotFoundError:  # the directory went (a /tmp cleaner): made again, once
            prepare(self.run_dir)
            write_atomically(self.path, payload)

    def _touch(self) -> None:
        try:
            os.utime(self.path)
        except FileNotFoundError:  # removed from under it
            self._write({"format": FORMAT, **self.identity, "devices": self._written})

    def _fixed_of(self, device: int) -> dict:
        fixed = self._fixed.get(device)
        if fixed is None:
            total = getattr(self._source, "device_total", None)
            fixed = {"uuid": self._uuid_of(device), "device_total": total(device) if total else None}
            if fixed["uuid"] is not None:  # asked again while torch cannot say
                self._fixed[device] = fixed
        return fixed

    def _fail(self, error: Exception) -> None:
        self.stop()
        sys.stderr.write(f"gpumem: figures for `gpumem top` are no longer published ({relayed(error)}); the "
                         f"program goes on ({TURN_OFF}).\n")


def write_atomically(path: str, payload: dict) -> None:
    """`payload` as JSON at `path`: a temporary file in its directory (0600), renamed over it."""
    directory, name = os.path.split(path)
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(payload, file, separators=(",", ":"))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _torch_uuid(device: int) -> Optional[str]:
    # Only once torch has initialized CUDA: asking earlier would initialize it.
    try:
        import torch

        return str(torch.cuda.get_device_properties(device).uuid) if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001: the UUID helps `gpumem top` match devices; the pid still matches
        return None
