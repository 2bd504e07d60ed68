"""What /proc says about a process: its start time, its pid namespace, the pids it has in nested
namespaces, its uid, its user and its command. For gpumem.monitoring.publish (a process's own identity) and gpumem.monitoring.top
(whether a published process is still the one that published).

Every function takes the proc root (`proc`, "/proc" on Linux) as a value, so tests build a tree of
their own, and returns None for what it cannot read (a process that ended, one another user owns
where the kernel hides it, a malformed file): a process gone is an ordinary answer here.

Note [pid reuse]
  A pid alone does not name a process: once it ends the kernel hands the number to the next one.
  (pid, start time) does: the start time, field 22 of /proc/<pid>/stat, is counted in clock ticks
  since boot, and no two processes with one pid share it. A published file carries both, and an
  entry whose pid now has another start time belongs to a process that has ended.
"""
from __future__ import annotations

import os
import pwd
from typing import Optional

PROC = "/proc"
_STAT_START_TIME = 19  # field 22 of stat, counted from field 3, the first after the command's ")"
_MAX_STATUS = 1 << 16  # /proc/<pid>/status is a few KiB
_MAX_COMMAND = 64


def start_time(pid: object, proc: str = PROC) -> Optional[int]:
    """The process's start time in clock ticks since boot; None if it cannot be read."""
    text = _read(f"{proc}/{pid}/stat", 4096)
    if text is None:
        return None
    # The command, in parentheses, may hold blanks and parentheses itself: the fields follow the last ")".
    fields = text.rpartition(")")[2].split()
    if len(fields) <= _STAT_START_TIME or not fields[_STAT_START_TIME].isdigit():
        return None
    return int(fields[_STAT_START_TIME])


def pid_namespace(pid: object, proc: str = PROC) -> Optional[str]:
    """The process's pid namespace, as its link names it ("pid:[4026531836]"); the same name
    wherever it is read from. None if the link cannot be read (another user's process)."""
    try:
        return os.readlink(f"{proc}/{pid}/ns/pid")
    except OSError:
        return None


def nested_pids(proc: str = PROC) -> dict[tuple[int, int], int]:
    """(pid inside its own namespace, start time) -> pid here, for every process here that lives in
    a nested pid namespace (a container's): the NSpid line of its status lists its pid in each
    namespace from this one inwards."""
    found = {}
    for pid in _pids(proc):
        inner = _innermost_pid(pid, proc)
        if inner is None:
            continue
        started = start_time(pid, proc)
        if started is not None:
            found[(inner, started)] = pid
    return found


def uid_of(pid: object, proc: str = PROC) -> Optional[int]:
    """The process's effective uid, as the Uid line of its status gives it (the uid its files get);
    None if it cannot be read."""
    text = _read(f"{proc}/{pid}/status", _MAX_STATUS)
    for line in (text or "").splitlines():
        if line.startswith("Uid:"):
            uids = line.split()[1:]
            return int(uids[1]) if len(uids) >= 2 and uids[1].isascii() and uids[1].isdigit() else None
    return None


def user_of(pid: object, proc: str = PROC) -> Optional[str]:
    """The name of the user who owns the process (its uid where it has no name)."""
    try:
        return user_name(os.stat(f"{proc}/{pid}").st_uid)
    except OSError:
        return None


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def command_of(pid: object, proc: str = PROC) -> Optional[str]:
    """The process's command name (comm, at most 15 characters as the kernel keeps it)."""
    text = _read(f"{proc}/{pid}/comm", _MAX_COMMAND)
    if text is None or not text.strip():
        return None
    return text.strip()


def _innermost_pid(pid: int, proc: str) -> Optional[int]:
    text = _read(f"{proc}/{pid}/status", _MAX_STATUS)
    for line in (text or "").splitlines():
        if line.startswith("NSpid:"):
            pids = line.split()[1:]
            return int(pids[-1]) if len(pids) > 1 and pids[-1].isdigit() else None
    return None


def _pids(proc: str) -> list[int]:
    try:
        return [int(name) for name in os.listdir(proc) if name.isascii() and name.isdigit()]
    except OSError:
        return []


def _read(path: str, limit: int) -> Optional[str]:
    try:
        with open(path, "rb") as file:
            return file.read(limit).decode("utf-8", "replace")
    except OSError:
        return None
