"""The files gpumem processes publish for `gpumem top` (gpumem.publish writes them): where they
are, what they hold, and reading them back, every file taken as hostile.

A file is <run dir>/<pid>.json, at most MAX_FILE_BYTES, of FORMAT:

    {"format": 1, "pid": 4242, "start_time": 81234567, "pid_namespace": "pid:[4026531836]",
     "job": "bert", "devices": [{"index": 0, "uuid": "5e4f...", "device_total": 150...,
     "allocated": ..., "allocated_peak": ..., "reserved": ..., "reserved_peak": ...,
     "limit": 21474836480, "outside": 0, "ooms": {"over_limit": 0, "device_full": 0, "fragmentation": 0},
     "floor": 0, "borrowed": 0, "given_back": 0, "asks_served": 0, "scope": "allocator", "sharing": false}]}

A device's figures are those of gpumem._figures.PUBLISHED, under their keys, read as that list
says (reserved is the cap's: Note [which reserved] there). "scope" is what the limit bounds
("process": the whole process, as gpumem.set_limit's scope) and "outside" the process's memory
outside gpumem counted against it (0 under "allocator"); a file without them, or without the
sharing figures (an older gpumem's), reads as "allocator" and 0.

The run directories (default_run_dir, GPUMEM_RUN_DIR) and why they are trusted are in
gpumem.publish; `gpumem top` reads a directory others may write to only when it is sticky
(shared_dir_problem), and each file only after the checks below: a regular file (no FIFO, no
link), its pid the one its name says, every figure a whole number in range, every text short.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Optional

from gpumem import _figures, _scope
from gpumem._words import relayed, shown_path
from gpumem.snapshot_file import read_at_most

FORMAT = 1
STALE_SECONDS = 60.0  # six heartbeats (gpumem.publish.HEARTBEAT_SECONDS) missed
RUN_DIR_BASE = "/tmp"
MAX_FILE_BYTES = 1 << 16  # a file holds a few hundred bytes per device
MAX_FILES = 4096  # per run directory, read by `gpumem top`
MAX_DEVICES = 64
_MAX_TEXT = 128  # a job name (metrics cuts it there), a namespace, a UUID
NAME = re.compile(r"([0-9]{1,10})\.json")
TEMPORARY = re.compile(r"\.[0-9]{1,10}\.json\..*\.tmp")  # what gpumem.publish.write_atomically leaves
_DEFAULT_DIR = re.compile(r"gpumem-([0-9]{1,10})")


@dataclass(frozen=True)
class RunDir:
    """Where the files go: `path`, and whether GPUMEM_RUN_DIR chose it (else it is the default,
    which must be the user's own)."""
    path: str
    chosen: bool = False


def default_run_dir() -> RunDir:
    return RunDir(os.path.join(RUN_DIR_BASE, f"gpumem-{os.geteuid()}"))


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
        named = ((item, NAME.fullmatch(item.name)) for item in listing)
        for item, match in itertools.islice(((i, m) for i, m in named if m), MAX_FILES):
            try:
                entries.append(_read_entry(item.path, int(match.group(1))))
            except FileNotFoundError:
                continue  # its process ended as it was listed
            except (OSError, ValueError, RecursionError) as error:
                problems.append(f"{shown_path(item.path)}: {relayed(error)}")
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
                if TEMPORARY.fullmatch(item.name) and now - item.stat(follow_symlinks=False).st_mtime > STALE_SECONDS:
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
    for figure in _figures.PUBLISHED:  # the shape first, then the values
        if figure.label_values and not isinstance(data.get(figure.key), dict):
            raise ValueError(f"a device's {figure.key} is not an object")
    total = data.get("device_total")
    checked = {"index": _count(data.get("index"), "index", MAX_DEVICES - 1),
               "uuid": _text(data.get("uuid"), "uuid", optional=True),
               "device_total": None if total is None else _count(total, "device_total")}
    checked.update({figure.key: _checked_figure(figure, data) for figure in _figures.PUBLISHED})
    scope = data.get("scope", _scope.ALLOCATOR)
    if scope not in (_scope.ALLOCATOR, _scope.PROCESS):
        raise ValueError(f"scope is not {_scope.FORMS}")
    checked["scope"] = scope
    sharing = data.get("sharing", False)
    if not isinstance(sharing, bool):
        raise ValueError("sharing is not true or false")
    checked["sharing"] = sharing
    return checked


def _checked_figure(figure: _figures.Figure, data: dict):
    """A figure as a file holds it: a count, or for a figure with one count per label value (the
    OOMs by case), an object with a count for each value."""
    if figure.label_values:
        counts = data[figure.key]  # an object: _checked_device saw to it
        return {label: _count(counts.get(label), f"{figure.key} {label}") for label in figure.label_values}
    return _count(data.get(figure.key, figure.default), figure.key)


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
