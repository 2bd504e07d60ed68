"""The files gpumem processes publish for `gpumem top` (gpumem.monitoring.publish writes them): where they
are, what they hold, and reading them back, every file taken as hostile.

A file is <run dir>/<pid>-<16 hex digits>.json (the digits random, so that nobody can take the name
first: Note [names nobody can take first]; an older gpumem's <pid>.json is read too), at most
MAX_FILE_BYTES, of FORMAT:

    {"format": 1, "pid": 4242, "start_time": 81234567, "pid_namespace": "pid:[4026531836]",
     "job": "bert", "devices": [{"index": 0, "uuid": "5e4f...", "device_total": 150...,
     "allocated": ..., "allocated_peak": ..., "reserved": ..., "reserved_peak": ...,
     "counted": ..., "counted_peak": ..., "limit": 21474836480, "outside": 0, "ooms": {"over_limit": 0, "device_full": 0, "fragmentation": 0},
     "floor": 0, "borrowed": 0, "given_back": 0, "asks_served": 0, "scope": "allocator", "sharing": false}]}

A device's figures are those of gpumem.monitoring.figures.PUBLISHED, under their keys, read as that list
says (reserved and counted, each with its peak: Note [which reserved] there; an older gpumem's file
without counted reads as reserved + outside). "scope" is what the limit bounds
("process": the whole process, as gpumem.set_limit's scope) and "outside" the process's memory
outside gpumem counted against it (0 under "allocator"); a file without them, or without the
sharing figures (an older gpumem's), reads as "allocator" and 0.

The run directories are the default one (/tmp/gpumem-<uid>) or GPUMEM_RUN_DIR's; whether one is
trusted, to read, to publish in or to hold a sharing table, is run_dir_problem's alone (Note
[trusting a run directory]). `gpumem top` reads each file only after the checks below: a regular
file (no FIFO, no link), its pid the one its name says, every figure a whole number in range,
every text short.

Note [trusting a run directory]
  One rule, run_dir_problem, for every use of a run directory: `gpumem top` reading it (READ),
  a process publishing its figures in it (PUBLISH, gpumem.monitoring.publish) and the tables of GPUs shared
  with other processes (SHARE, gpumem.sharing; the compiled layer opens the table where it is told).
    READ     a directory. One that users besides its owner may write to must be sticky, as /tmp
             is: without the bit any of them could remove or replace a process's files. A default
             directory (gpumem-<uid>) must belong to the uid its name says, and not be a link: one
             made by someone else is a plant, never read.
    PUBLISH  READ's, and this user may write to it. The default directory, which any user could
             have made first under /tmp, must also be this user's own and private (no access for
             group or others). A GPUMEM_RUN_DIR is used as it is otherwise: an administrator may
             share one, sticky, with containers and users.
    SHARE    PUBLISH's, and the directory belongs to this user and nobody else may write to it,
             sticky or not: every member maps the table and writes its slot, and a user who could
             create files there could take the table's name first (the compiled layer then refuses
             the file, and nobody shares) or, as the directory's owner, replace the table.
  A link given as GPUMEM_RUN_DIR is followed: the directory it leads to is what is checked.

Note [names nobody can take first]
  In a directory shared by several users (sticky, as /tmp), a name is whoever's creates it first.
  A name another user can predict (<pid>.json) they can create before the process publishes, and
  the process then cannot (a sticky directory forbids renaming over another user's file). So each
  publisher picks its name once, with 64 random bits: <pid>-<random>.json, and its temporary file
  is made with a random name by mkstemp (O_EXCL). The pid in the name is what `gpumem top` checks
  the file's content against; a stale file is told by its pid and start time, as before, never by
  its name alone.
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

from gpumem.monitoring import figures
from gpumem.settings import scope as _scope
from gpumem.settings.echo import relayed, shown_path
from gpumem.settings.files import read_at_most
from gpumem.settings.run_dir import RUN_DIR_BASE, RunDir

FORMAT = 1
STALE_SECONDS = 60.0  # six heartbeats (gpumem.monitoring.publish.HEARTBEAT_SECONDS) missed
MAX_FILE_BYTES = 1 << 16  # a file holds a few hundred bytes per device
MAX_FILES = 4096  # per run directory, read by `gpumem top`
MAX_DEVICES = 64
_MAX_TEXT = 128  # a job name (metrics cuts it there), a namespace, a UUID
NAME_RANDOM_DIGITS = 16  # hex: 64 bits (Note [names nobody can take first])
_RANDOM_PART = f"(?:-[0-9a-f]{{{NAME_RANDOM_DIGITS}}})?"  # absent from an older gpumem's names
NAME = re.compile(rf"([0-9]{{1,10}}){_RANDOM_PART}\.json")
TEMPORARY = re.compile(rf"\.[0-9]{{1,10}}{_RANDOM_PART}\.json\..*\.tmp")  # what publish.write_atomically leaves
READ, PUBLISH, SHARE = "read", "publish", "share"  # the uses of a run directory (run_dir_problem)
_DEFAULT_DIR = re.compile(r"gpumem-([0-9]{1,10})")


def file_name(pid: int, random_part: str) -> str:
    """The name of a process's figures file (Note [names nobody can take first])."""
    return f"{pid}-{random_part}.json"


def run_dir_problem(run_dir: RunDir, use: str) -> Optional[str]:
    """Why `run_dir` cannot be trusted for `use` (READ, PUBLISH or SHARE), or None: the one rule,
    Note [trusting a run directory]. OSError if it cannot be looked at (FileNotFoundError: missing)."""
    info = os.stat(run_dir.path) if run_dir.chosen else os.lstat(run_dir.path)
    problem = _not_its_users(run_dir, info) or _open_to_others(info)
    if problem is not None or use == READ:
        return problem
    if not os.access(run_dir.path, os.W_OK | os.X_OK):
        return "is not writable by this user"
    mode = stat.filemode(info.st_mode)
    if not run_dir.chosen and (info.st_uid != os.geteuid() or info.st_mode & 0o077):
        return (f"is not a private directory of this user (owner uid {info.st_uid}, mode {mode}): remove it, or "
                "set GPUMEM_RUN_DIR")
    if use == SHARE and info.st_uid != os.geteuid():
        return (f"belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}): its owner could replace a "
                "GPU's sharing table; share in a directory of your own (GPUMEM_RUN_DIR)")
    if use == SHARE and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"is writable by other users (mode {mode}): any of them could take a sharing table's name first; "
                "share in a directory only you may write to (GPUMEM_RUN_DIR)")
    return None


def _not_its_users(run_dir: RunDir, info: os.stat_result) -> Optional[str]:
    """Why this is not a directory, or for a default one (gpumem-<uid>) not one of the uid its name says."""
    if stat.S_ISLNK(info.st_mode):  # only a default directory is looked at without following links
        return "is not a private directory of this user (a link): remove it, or set GPUMEM_RUN_DIR"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    match = None if run_dir.chosen else _DEFAULT_DIR.fullmatch(os.path.basename(run_dir.path))
    if match and info.st_uid != int(match.group(1)):
        return (f"belongs to uid {info.st_uid}, not to the uid {match.group(1)} its name says (someone else made it): "
                "remove it, or set GPUMEM_RUN_DIR")
    return None


def _open_to_others(info: os.stat_result) -> Optional[str]:
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
    # Whose directory it is, by run_dir_problem's rule; what else is wrong is said when it is read.
    if not _DEFAULT_DIR.fullmatch(item.name):
        return False
    try:
        return _not_its_users(RunDir(item.path), item.stat(follow_symlinks=False)) is None
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
    for figure in figures.PUBLISHED:  # the shape first, then the values
        if figure.label_values and not isinstance(data.get(figure.key), dict):
            raise ValueError(f"a device's {figure.key} is not an object")
    total = data.get("device_total")
    checked = {"index": _count(data.get("index"), "index", MAX_DEVICES - 1),
               "uuid": _text(data.get("uuid"), "uuid", optional=True),
               "device_total": None if total is None else _count(total, "device_total")}
    checked.update({figure.key: _checked_figure(figure, data) for figure in figures.PUBLISHED
                    if figure.older is None or figure.key in data})
    for figure in figures.PUBLISHED:  # an older gpumem's file, without the figures added since
        if figure.key not in checked:
            checked[figure.key] = figure.older(checked)
    scope = data.get("scope", _scope.ALLOCATOR)
    if scope not in (_scope.ALLOCATOR, _scope.PROCESS):
        raise ValueError(f"scope is not {_scope.FORMS}")
    checked["scope"] = scope
    sharing = data.get("sharing", False)
    if not isinstance(sharing, bool):
        raise ValueError("sharing is not true or false")
    checked["sharing"] = sharing
    return checked


def _checked_figure(figure: figures.Figure, data: dict):
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
