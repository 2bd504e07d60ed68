"""Each gpumem process's figures in a small file, for `gpumem top` (gpumem.top) to read.

    /tmp/gpumem-1000/4242.json
    {"format": 1, "pid": 4242, "start_time": 81234567, "pid_namespace": "pid:[4026531836]",
     "job": "bert", "devices": [{"index": 0, "uuid": "5e4f...", "device_total": 150...,
     "limit": 21474836480, "allocated": ..., "allocated_peak": ..., "reserved": ...,
     "reserved_peak": ..., "ooms": {"over_limit": 0, "device_full": 0, "fragmentation": 0},
     "scope": "allocator", "outside": 0}]}

"scope" is what the limit bounds ("process": the whole process, as gpumem.set_limit's scope) and
"outside" the process's memory outside gpumem counted against it (0 under "allocator"); a file
without them (an older gpumem's) reads as "allocator" and 0.

Where. The run directory: GPUMEM_RUN_DIR, else /tmp/gpumem-<uid>, made 0700 by the first process
that publishes. /tmp because it is there in every process (batch jobs, services and containers
have no XDG_RUNTIME_DIR, and /run/user/<uid> goes at logout, with a job still running), and one
pattern lets `gpumem top`, run as root, find every user's directory. Not $TMPDIR, which schedulers
set per job: the jobs would not see each other. The default directory must be this user's own and
private (not a link, no access for others): one that another user made first is refused, so no one
else can plant or read the files. A GPUMEM_RUN_DIR is used as it is (an administrator may share one
with containers), unless users besides its owner may write to it and it is not sticky
(shared_dir_problem); it is made 0700 if missing. Files are 0600.

When. A daemon thread, `gpumem-publish`, started when the process first initializes CUDA (as the
metrics endpoint, gpumem._monitoring: a launcher or a DataLoader worker publishes nothing), wakes
every PUBLISH_SECONDS, reads the figures of the devices in use (existing_devices, stats and
get_limit: one copy of the statistics per device, the allocator's lock held for the copy only, no
CUDA call), and rewrites the file only when a figure changed: written to a temporary file in the
directory, then renamed over the old one, so a reader sees the old figures or the new, never half.
The file appears once a device has held memory. Every HEARTBEAT_SECONDS without a change the file's
time is touched (and the file written again if someone removed it): how a reader that cannot look
the process up (another pid namespace) tells a live one from one that was killed.

Stale files. The process removes its file at exit (atexit; a forked child leaves its parent's
alone). A process killed outright leaves it behind: `gpumem top` removes it once the pid is gone or
has another start time (Note [pid reuse] in gpumem._proc), or, for a process it cannot look up,
once the file has not been touched for STALE_SECONDS.

Errors. Publishing never stops the program: what goes wrong (the directory refused, a full disk)
is one line on stderr, the file is removed, and the process goes on without publishing.
GPUMEM_PUBLISH=0 turns it off.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from gpumem import _C, _proc, _scope, metrics
from gpumem._words import bounded, shown_path
from gpumem.snapshot_file import read_at_most

FORMAT = 1
PUBLISH_SECONDS = 1.0
HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 60.0  # six heartbeats missed
RUN_DIR_BASE = "/tmp"
MAX_FILE_BYTES = 1 << 16  # a file holds a few hundred bytes per device
MAX_FILES = 4096  # per run directory, read by `gpumem top`
MAX_DEVICES = 64
_MAX_TEXT = 128  # a job name (metrics cuts it there), a namespace, a UUID
STATS = {  # the figures a file holds per device, besides the limit -> the statistic each one is
    "allocated": "allocated_bytes.all.current",
    "allocated_peak": "allocated_bytes.all.peak",
    "reserved": "reserved_bytes.all.current",
    "reserved_peak": "reserved_bytes.all.peak",
}
# Sharing a GPU (gpumem.sharing): the floor, reserved above it, bytes given back on request, and
# the requests answered; 0 where the process does not share. As _C.share_status computes them.
SHARING = ("floor", "borrowed", "given_back", "asks_served")
_NAME = re.compile(r"([0-9]{1,10})\.json")
_TEMPORARY = re.compile(r"\.[0-9]{1,10}\.json\..*\.tmp")
_DEFAULT_DIR = re.compile(r"gpumem-([0-9]{1,10})")
_TURN_OFF = "GPUMEM_PUBLISH=0 turns publishing off"


@dataclass(frozen=True)
class RunDir:
    """Where the files go: `path`, and whether GPUMEM_RUN_DIR chose it (else it is the default,
    which must be the user's own)."""
    path: str
    chosen: bool = False


def default_run_dir() -> RunDir:
    return RunDir(os.path.join(RUN_DIR_BASE, f"gpumem-{os.geteuid()}"))


def prepare(run_dir: RunDir) -> None:
    """Makes the directory (0700) if it is missing; OSError if it cannot be used."""
    if run_dir.chosen:
        os.makedirs(run_dir.path, 0o700, exist_ok=True)
        if not os.access(run_dir.path, os.W_OK | os.X_OK):
            raise PermissionError(f"{shown_path(run_dir.path)} is not writable by this user")
        problem = shared_dir_problem(os.stat(run_dir.path))
        if problem is not None:
            raise PermissionError(f"{shown_path(run_dir.path)} {problem}")
        return
    with contextlib.suppress(FileExistsError):
        os.mkdir(run_dir.path, 0o700)
    info = os.lstat(run_dir.path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise PermissionError(f"{shown_path(run_dir.path)} is not a private directory of this user (owner uid "
                              f"{info.st_uid}, mode {stat.filemode(info.st_mode)}): remove it, or set "
                              "GPUMEM_RUN_DIR")


def shared_dir_problem(info: os.stat_result) -> Optional[str]:
    """Why a run directory with this stat cannot be trusted, or None: one that users besides its owner
    may write to must be sticky (as /tmp is), or they could remove and replace each other's files.
    See Note [whose figures] in gpumem.top."""
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        return (f"is writable by other users and not sticky (mode {stat.filemode(info.st_mode)}): any of them "
                "could remove or replace the files in it; make it sticky (chmod +t), as /tmp is, or private")
    return None


# ---- writing --------------------------------------------------------------------------------------


def own_identity(job: Optional[str] = None) -> dict:
    """What names this process in its file: pid, start time, pid namespace and job."""
    pid = os.getpid()
    started = _proc.start_time(pid)
    if started is None:
        raise OSError(f"/proc/{pid}/stat cannot be read, and without the start time a reused pid would pass "
                      "for this process")
    return {"pid": pid, "start_time": started, "pid_namespace": _proc.pid_namespace(pid),
            "job": metrics.job_name() if job is None else job}


def device_figures(source, fixed: Callable[[int], dict]) -> list[dict]:
    """The figures of each device in use that has held memory or refused some; `fixed(device)`:
    what does not change (uuid, device_total)."""
    devices = []
    for device in source.existing_devices():
        stats = source.stats(device)
        if stats["reserved_bytes.all.peak"] == 0 and stats["num_ooms"] == 0:
            continue  # made by a setting (set_limit on it), never used
        figures = {"index": device, **fixed(device), "limit": source.get_limit(device)}
        figures.update({name: stats[key] for name, key in STATS.items()})
        figures["ooms"] = {case: stats[key] for case, key in metrics.OOM_CASES.items()}
        figures["scope"] = source.get_scope(device)
        figures["outside"] = source.outside(device)  # 0 under the allocator scope
        share_status = getattr(source, "share_status", None)
        sharing = share_status(device) if share_status is not None else None
        figures.update({name: sharing[name] if sharing else 0 for name in SHARING})
        figures["sharing"] = sharing is not None
        devices.append(figures)
    return devices


class Publisher:
    """Keeps <run dir>/<pid>.json up to date with one process's figures (see the module's docstring).

    `source`: gpumem._C (the process's allocator) by default, or anything with its existing_devices(),
    stats(device), get_limit(device), get_scope(device) and outside(device), such as a SimAllocator.
    `identity`: own_identity() by default.
    `uuid_of(device)`: the device's UUID, or None. `clock`: seconds, for the heartbeat.
    """

    def __init__(self, run_dir: RunDir, source=None, identity: Optional[dict] = None,
                 uuid_of: Optional[Callable[[int], Optional[str]]] = None, interval: float = PUBLISH_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.run_dir = run_dir
        self.identity = own_identity() if identity is None else identity
        self.path = os.path.join(run_dir.path, f"{self.identity['pid']}.json")
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
        sys.stderr.write(f"gpumem: figures for `gpumem top` are no longer published ({_reason(error)}); the "
                         f"program goes on ({_TURN_OFF}).\n")


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


_process_publisher: Optional[Publisher] = None


def start_for_environment(run_dir: RunDir) -> Optional[Publisher]:
    """The process's publisher, started (once): gpumem._monitoring calls it at CUDA init. Never
    raises: what stops it is one line on stderr, and None."""
    global _process_publisher
    if _process_publisher is not None and _process_publisher.owner == os.getpid():
        return _process_publisher
    try:
        prepare(run_dir)
        publisher = Publisher(run_dir)
        publisher.start()
    except Exception as error:  # noqa: BLE001: publishing must never stop the program
        sys.stderr.write(f"gpumem: figures for `gpumem top` are not published in {shown_path(run_dir.path)} "
                         f"({_reason(error)}); the program goes on ({_TURN_OFF}).\n")
        return None
    atexit.register(publisher.stop)
    _process_publisher = publisher
    return publisher


def _reason(error: Exception) -> str:
    return bounded(str(error).removeprefix("gpumem: ") or type(error).__name__)


# ---- reading (gpumem top) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One published file, checked. `uid`: the file's owner; `file_id`: (inode, mtime in ns) as
    read, so a file written again since is not removed as stale."""
    path: str
    pid: int
    start_time: int
    pid_namespace: Optional[str]
    job: str
    devices: tuple
    uid: int
    mtime: float
    file_id: tuple


def run_dirs(run_dir: RunDir, base: str = RUN_DIR_BASE) -> list[str]:
    """The directories `gpumem top` reads: GPUMEM_RUN_DIR's, else every user's default one
    (/tmp/gpumem-<uid>, owned by that uid; another is someone's plant, and left alone)."""
    if run_dir.chosen:
        return [run_dir.path]
    found = []
    with contextlib.suppress(OSError), os.scandir(base) as listing:
        found = [item.path for item in listing if _is_a_users_run_dir(item)]
    return sorted(found)


def _is_a_users_run_dir(item: os.DirEntry) -> bool:
    match = _DEFAULT_DIR.fullmatch(item.name)
    try:
        return bool(match) and item.is_dir(follow_symlinks=False) and \
            item.stat(follow_symlinks=False).st_uid == int(match.group(1))
    except OSError:
        return False


def read_entries(directory: str) -> tuple[list[Entry], list[str]]:
    """The files in `directory` (MAX_FILES at most), and what is wrong with those that cannot be
    used ("path: reason"). OSError if the directory cannot be listed."""
    entries, problems = [], []
    with os.scandir(directory) as listing:
        named = ((item, _NAME.fullmatch(item.name)) for item in listing)
        for item, match in itertools.islice(((i, m) for i, m in named if m), MAX_FILES):
            try:
                entries.append(_read_entry(item.path, int(match.group(1))))
            except FileNotFoundError:
                continue  # its process ended as it was listed
            except (OSError, ValueError, RecursionError) as error:
                problems.append(f"{shown_path(item.path)}: {_reason(error)}")
    return entries, problems


def remove_if_unchanged(entry: Entry) -> bool:
    """Removes a stale entry's file, unless it was written since it was read (a new process with
    the pid); whether it did."""
    try:
        info = os.lstat(entry.path)
        if (info.st_ino, info.st_mtime_ns) != entry.file_id:
            return False
        os.unlink(entry.path)
    except OSError:  # gone already, or another user's directory
        return False
    return True


def remove_stale_temporaries(directory: str, now: float) -> None:
    """Temporary files a writer killed mid-write left, once STALE_SECONDS old."""
    with contextlib.suppress(OSError), os.scandir(directory) as listing:
        for item in itertools.islice(listing, 4 * MAX_FILES):
            with contextlib.suppress(OSError):
                if _TEMPORARY.fullmatch(item.name) and now - item.stat(follow_symlinks=False).st_mtime > STALE_SECONDS:
                    os.unlink(item.path)


def _read_entry(path: str, pid: int) -> Entry:
    # O_NONBLOCK: a FIFO planted under the name must not hang the reader.
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        data = read_at_most(descriptor, MAX_FILE_BYTES + 1)
    finally:
        os.close(descriptor)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes: not a gpumem figures file")
    fields = _checked(json.loads(data), pid)
    return Entry(path=path, uid=info.st_uid, mtime=info.st_mtime, file_id=(info.st_ino, info.st_mtime_ns), **fields)


def _checked(data: object, pid: int) -> dict:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a gpumem figures file of format {FORMAT}")
    if _count(data.get("pid"), "pid") != pid:
        raise ValueError("its pid is not the one its name says")
    devices = data.get("devices")
    if not isinstance(devices, list) or len(devices) > MAX_DEVICES:
        raise ValueError(f"devices is not a list of at most {MAX_DEVICES}")
    return {"pid": pid, "start_time": _count(data.get("start_time"), "start_time"),
            "pid_namespace": _text(data.get("pid_namespace"), "pid_namespace", optional=True),
            "job": _text(data.get("job"), "job"), "devices": tuple(_checked_device(d) for d in devices)}


def _checked_device(data: object) -> dict:
    if not isinstance(data, dict):
        raise ValueError("a device is not an object")
    ooms = data.get("ooms")
    if not isinstance(ooms, dict):
        raise ValueError("a device's ooms is not an object")
    total = data.get("device_total")
    checked = {"index": _count(data.get("index"), "index", MAX_DEVICES - 1),
               "uuid": _text(data.get("uuid"), "uuid", optional=True),
               "device_total": None if total is None else _count(total, "device_total"),
               "limit": _count(data.get("limit"), "limit")}
    checked.update({name: _count(data.get(name), name) for name in STATS})
    checked["ooms"] = {case: _count(ooms.get(case), f"ooms {case}") for case in metrics.OOM_CASES}
    scope = data.get("scope", _scope.ALLOCATOR)
    if scope not in (_scope.ALLOCATOR, _scope.PROCESS):
        raise ValueError(f"scope is not {_scope.FORMS}")
    checked["scope"] = scope
    checked["outside"] = _count(data.get("outside", 0), "outside")
    checked.update({name: _count(data.get(name, 0), name) for name in SHARING})
    sharing = data.get("sharing", False)
    if not isinstance(sharing, bool):
        raise ValueError("sharing is not true or false")
    checked["sharing"] = sharing
    return checked


def _count(value: object, name: str, most: int = (1 << 64) - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ValueError(f"{name} is not a whole number in 0..{most}")
    return value


def _text(value: object, name: str, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ValueError(f"{name} is not a string of at most {_MAX_TEXT} characters")
    return value
