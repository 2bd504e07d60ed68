"""`gpumem top`: every process on the machine that uses a GPU, with gpumem's figures for those under it.

    gpumem top                 one table
    gpumem top --watch [2]     the table again every 2 seconds, until Ctrl-C
    gpumem top --json          one JSON document (one a line per refresh, with --watch)

Two sources, joined by pid:
  - NVML (gpumem.monitoring.nvml): per GPU, each process with a context on it, and the memory the driver
    counts for it (its context and every allocator's memory: gpumem's reserved among them);
  - the files gpumem processes publish (gpumem.monitoring.publish writes them, gpumem.monitoring.published reads them): per device in use, the limit, allocated,
    reserved, their peaks and the out-of-memory errors by case.
A published device is matched to NVML's GPU by UUID (where its UUID names no GPU, as for a MIG
instance, by the only GPU NVML lists the pid on, if the process has one device). A row is marked
once reserved has reached `warn_at` of the limit (as the pressure alerts count a crossing);
without a limit the share is of the device. Published processes that NVML does not list are
shown too, flagged.

Note [pids across namespaces]
  NVML gives each process's pid in the host's pid namespace; a process in a container knows itself
  by another pid, and publishes that one, with its start time and its namespace. Run in the host's
  namespace (with the run directory shared with the container), `gpumem top` finds the host pid
  of such a process: the one whose NSpid line (/proc/<pid>/status) ends in the published pid and
  whose start time is the published one (the same from every namespace). Run inside a container,
  it sees no host pid in its /proc: NVML's rows keep pids it cannot name, and the container's own
  gpumem processes are shown apart, flagged as not in NVML's list.

Note [whose figures]
  A file is trusted as a process's figures only when its owner is the process's user: the file's
  uid is the effective uid in the process's /proc/<pid>/status (the uid a file it writes gets, the
  same from every pid namespace, and mapped the same by a user namespace). Nobody but root can make
  a file another user owns, so a file one user plants for another's process, in a directory of
  their own or a shared one, is skipped and named under the table, and the process's real file is
  used; of two files that pass for one process, the first by path is. A directory that users besides
  its owner may write to is read only if it is sticky, as /tmp is (published.run_dir_problem): in
  one that is not, anyone could remove a process's file or put a file of their own in its place.
  A file of a process that cannot be seen from here (Note [pids across namespaces]) cannot be
  checked against it: its row says whose file it is (USER) and that its pid is in another
  namespace. A file whose time is ahead of the clock (by more than CLOCK_SLACK_SECONDS) is skipped:
  its heartbeat cannot be read, and it would never go stale.

Note [stale entries]
  A published file whose process ended without removing it (killed) is left out and removed. For a
  process of this pid namespace that is certain: its pid is gone or has another start time (Note
  [pid reuse] in gpumem.monitoring.proc). A process of another namespace that cannot be found from here
  (a container's, with top inside another container) may be alive: its file counts as stale once
  its publisher has not touched it for published.STALE_SECONDS. A file written again since it was
  read (a new process with the pid) is not removed.
"""
from __future__ import annotations

import collections
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from gpumem.monitoring import figures as _figures, nvml as _nvml, proc as _proc, published
from gpumem.settings import scope, sizes
from gpumem.settings.echo import shown, shown_path
from gpumem.settings.run_dir import RunDir

WARN_AT = 0.85
CLOCK_SLACK_SECONDS = 2.0  # a file written while the view is made is a little ahead of its time
CLEAR_SCREEN = "\x1b[H\x1b[2J"
open_nvml: Callable[[], object] = _nvml.Nvml  # the GPUs are read through it; tests put a fake NVML here
sleep: Callable[[float], None] = time.sleep  # between refreshes; tests replace it
_JOB_WIDTH = 24
_MAX_PROBLEMS = 5


@dataclass(frozen=True)
class Row:
    """One process on one GPU. `pid` as this pid namespace sees it (None: it cannot), `own_pid` the
    one it published where that differs; `figures` its published device, None if not under gpumem."""
    gpu: Optional[int]
    pid: Optional[int]
    own_pid: Optional[int]
    user: Optional[str]
    job: Optional[str]
    command: Optional[str]
    used: Optional[int]
    figures: Optional[dict]
    in_nvml: bool
    share: Optional[float]
    past: bool


@dataclass(frozen=True)
class View:
    time: float
    gpus: list
    rows: list
    warn_at: float
    run_dirs: list
    stale_removed: int
    problems: list


def run(nvml, run_dirs: list[str], warn_at: float, as_json: bool = False, every: Optional[float] = None,
        proc: str = _proc.PROC) -> int:
    """Prints the view once, or every `every` seconds until interrupted (KeyboardInterrupt)."""
    clear = every is not None and not as_json and sys.stdout.isatty()
    while True:
        view = collect(nvml, run_dirs, warn_at, proc)
        if as_json:
            print(json.dumps(document(view), separators=(",", ":")))
        else:
            print((CLEAR_SCREEN if clear else "") + _heading(view, every) + table(view))
        if every is None:
            return 0
        sys.stdout.flush()
        sleep(every)


def collect(nvml, run_dirs: list[str], warn_at: float, proc: str = _proc.PROC, now: Optional[float] = None) -> View:
    """NVML's processes joined with the published figures; stale files removed."""
    now = time.time() if now is None else now
    gpus = nvml.gpus()
    entries, problems = _read(run_dirs, now)
    placed, apart, stale = _locate(entries, proc, now, problems)
    removed = sum(published.remove_if_unchanged(entry) for entry in stale)
    rows = _rows(gpus, placed, apart, warn_at, proc)
    return View(now, gpus, rows, warn_at, list(run_dirs), removed, problems)


# ---- joining ----------------------------------------------------------------------------------------


def _read(run_dirs: list[str], now: float) -> tuple[list, list[str]]:
    entries, problems = [], []
    for directory in run_dirs:
        try:
            # chosen: a default directory was found by its owner already (published.run_dirs)
            problem = published.run_dir_problem(RunDir(directory, chosen=True), published.READ)
            if problem is not None:
                problems.append(f"{shown_path(directory)} {problem}")
                continue
            found, wrong = published.read_entries(directory)
        except FileNotFoundError:
            continue  # no process has published there yet
        except OSError as error:
            advice = ": run as root to see every user's processes" if isinstance(error, PermissionError) else ""
            problems.append(f"{shown(directory)} cannot be read ({error.strerror or error}){advice}")
            continue
        published.remove_stale_temporaries(directory, now)
        entries += found
        problems += wrong
    return sorted(entries, key=lambda entry: entry.path), problems


def _locate(entries: list, proc: str, now: float, problems: list[str]) -> tuple[dict, list, list]:
    """(pid here -> entry of a live process, live entries whose pid cannot be seen from here, stale
    entries); what is skipped is said in `problems`. See Note [pids across namespaces], Note [stale
    entries] and Note [whose figures]."""
    mine = _proc.pid_namespace("self", proc)
    placed, apart, stale = {}, [], []
    nested = None
    for entry in entries:
        if entry.mtime > now + CLOCK_SLACK_SECONDS:
            problems.append(f"{shown_path(entry.path)}: written {entry.mtime - now:.0f} s in the future: no heartbeat "
                            "can be read from it")
            continue
        if mine is not None and entry.pid_namespace == mine:
            if _proc.start_time(entry.pid, proc) != entry.start_time:
                stale.append(entry)
                continue
            pid = entry.pid
        else:
            if nested is None:
                nested = _proc.nested_pids(proc)
            pid = nested.get((entry.pid, entry.start_time))
            if pid is None:
                (stale if now - entry.mtime > published.STALE_SECONDS else apart).append(entry)
                continue
        problem = _not_its_file(entry, pid, placed, proc)
        if problem is None:
            placed[pid] = entry
        else:
            problems.append(f"{shown_path(entry.path)}: {problem}")
    return placed, apart, stale


def _not_its_file(entry, pid: int, placed: dict, proc: str) -> Optional[str]:
    """Why the entry is not the figures of process `pid` (as seen here), or None if it is."""
    uid = _proc.uid_of(pid, proc)
    if uid != entry.uid:
        runs_as = "whose user cannot be read" if uid is None else f"which runs as {_proc.user_name(uid)}"
        return f"the file is {_proc.user_name(entry.uid)}'s, but it names process {pid}, {runs_as}: not its figures"
    if pid in placed:
        return f"process {pid} has published its figures already, in {shown_path(placed[pid].path)}"
    return None


def _rows(gpus: list, placed: dict, apart: list, warn_at: float, proc: str) -> list[Row]:
    listed = collections.Counter(process.pid for gpu in gpus for process in gpu.processes)
    matched, rows = set(), []
    for gpu in gpus:
        for process in sorted(gpu.processes, key=lambda p: p.pid):
            entry = placed.get(process.pid)
            device = _device_on(entry, gpu, gpus, listed[process.pid]) if entry else None
            if device is not None:
                matched.add((process.pid, device["index"]))
            rows.append(_row(gpu.index, process.pid, entry, device, process.used, True, warn_at, proc))
    for pid, entry in sorted(placed.items()):
        rows += [_row(_gpu_of(device, gpus), pid, entry, device, None, False, warn_at, proc)
                 for device in entry.devices if (pid, device["index"]) not in matched]
    for entry in sorted(apart, key=lambda e: e.pid):
        rows += [_row(_gpu_of(device, gpus), None, entry, device, None, False, warn_at, proc)
                 for device in entry.devices]
    return rows


def _device_on(entry, gpu, gpus: list, gpus_listing_the_pid: int) -> Optional[dict]:
    """The entry's device that is this GPU: by UUID; else, for a process NVML lists on this GPU
    alone with one device whose UUID names no GPU (none known yet, a MIG instance's), that one."""
    for device in entry.devices:
        if device["uuid"] is not None and _uuid_key(device["uuid"]) == _uuid_key(gpu.uuid):
            return device
    if gpus_listing_the_pid == 1 and len(entry.devices) == 1 and _gpu_of(entry.devices[0], gpus) is None:
        return entry.devices[0]
    return None


def _gpu_of(device: dict, gpus: list) -> Optional[int]:
    if device["uuid"] is None:
        return None
    return next((gpu.index for gpu in gpus if _uuid_key(gpu.uuid) == _uuid_key(device["uuid"])), None)


def _uuid_key(uuid: str) -> str:
    # NVML writes "GPU-5e4f..." (or "MIG-..."), torch the bare UUID.
    key = uuid.strip().lower()
    return key[4:] if key[:4] in ("gpu-", "mig-") else key


def _row(gpu, pid, entry, device, used, in_nvml: bool, warn_at: float, proc: str) -> Row:
    user = _proc.user_of(pid, proc) if pid is not None else None
    if user is None and entry is not None:
        user = _proc.user_name(entry.uid)  # the file's owner
    # The share is of what the limit measures: counted (reserved, + outside under a limit on the whole process).
    share = device["counted"] / device["limit"] if device and device["limit"] else None
    return Row(gpu=gpu, pid=pid, own_pid=entry.pid if entry and entry.pid != pid else None, user=user,
               job=entry.job if entry else None, command=_proc.command_of(pid, proc) if pid is not None else None,
               used=used, figures=device, in_nvml=in_nvml, share=share, past=share is not None and share >= warn_at)


# ---- the table ------------------------------------------------------------------------------------

_COLUMNS = ("", "GPU", "PID", "USER", "JOB", "USED", "LIMIT", "ALLOCATED", "RESERVED", "PEAK", "OOMS", "CAP", "NOTE")
_RIGHT = {1, 2, 5, 6, 7, 8, 9, 10, 11}  # numbers, right-aligned


# Shown only where some process shares its GPU (gpumem.sharing): its floor, what it borrows above
# it, and what it gave back when others asked.
_SHARING_COLUMNS = ("FLOOR", "BORROWED", "GAVE BACK")


def table(view: View) -> str:
    lines = [_gpu_line(gpu) for gpu in view.gpus] or ["NVML lists no GPU"]
    lines.append("")
    if view.rows and any(row.figures is not None and row.figures.get("sharing") for row in view.rows):
        heading = (*_COLUMNS[:-1], *_SHARING_COLUMNS, _COLUMNS[-1])
        right = frozenset(_RIGHT | {len(_COLUMNS) - 1 + i for i in range(len(_SHARING_COLUMNS))})
        lines += _aligned([heading, *(_with_sharing(row) for row in view.rows)], right)
    elif view.rows:
        lines += _aligned([_COLUMNS, *(_cells(row) for row in view.rows)])
    else:
        lines.append("no process uses a GPU")
    return "\n".join(lines + _footnotes(view))


def _heading(view: View, every: Optional[float]) -> str:
    if every is None:
        return ""
    return f"gpumem top, every {every:g} s (Ctrl-C ends it), {time.strftime('%H:%M:%S', time.localtime(view.time))}\n\n"


def _gpu_line(gpu) -> str:
    name = f"GPU {gpu.index}  {_text(gpu.name)}  {_text(gpu.uuid)}"
    if gpu.error is not None:
        return f"{name}: cannot be read ({_text(gpu.error)})"
    return f"{name}  {_size(gpu.used)} of {_size(gpu.total)} used"


def _cells(row: Row) -> tuple[str, ...]:
    identity = ("!" if row.past else "", "?" if row.gpu is None else str(row.gpu), _number(row.pid),
                _cut(row.user or "-"), _cut(row.job or row.command or "-"), _size(row.used))
    f = row.figures
    if f is None:
        return (*identity, "-", "-", "-", "-", "-", "-", _note(row))
    return (*identity, "none" if _no_limit(f) else _size(f["limit"]), _size(f["allocated"]), _size(f["reserved"]),
            _size(f["reserved_peak"]), str(sum(f["ooms"].values())),
            "-" if row.share is None else f"{row.share:.0%}", _note(row))


def _with_sharing(row: Row) -> tuple[str, ...]:
    cells = _cells(row)
    f = row.figures
    if f is None or not f.get("sharing"):
        extra = ("-",) * len(_SHARING_COLUMNS)
    else:
        extra = (_size(f["floor"]), _size(f["borrowed"]), _size(f["given_back"]))
    return (*cells[:-1], *extra, cells[-1])


def _no_limit(figures: dict) -> bool:
    """Whether a published device runs without a limit (the limit is the device's total)."""
    return figures["device_total"] is not None and figures["limit"] >= figures["device_total"]


def _note(row: Row) -> str:
    notes = []
    if row.pid is None:
        notes.append(f"pid {row.own_pid} in another pid namespace")
    elif row.own_pid is not None:
        notes.append(f"pid {row.own_pid} in its container")
    if not row.in_nvml:
        notes.append("not in NVML's list")
    if row.figures is not None and row.gpu is None:
        notes.append(f"its device {row.figures['index']}, GPU not identified")
    if row.figures is not None and row.figures.get("paused"):
        notes.append(f"{_size(row.figures['paused'])} paused (gpumem.pause)")
    if row.figures is not None and row.figures["scope"] == scope.PROCESS:
        notes.append(f"limit on the whole process, {_size(row.figures['outside'])} outside gpumem")
    return "; ".join(notes)


def _footnotes(view: View) -> list[str]:
    notes = []
    if any(row.past for row in view.rows):
        notes.append(f"! reserved at {view.warn_at:.0%} of its limit or more (--warn-at, GPUMEM_WARN_AT)")
    if any(not row.in_nvml for row in view.rows):
        notes.append("not in NVML's list: NVML names processes by their pid on the host; inside a container "
                     "they cannot be matched (docs/monitoring.md)")
    if view.stale_removed:
        notes.append(f"{view.stale_removed} stale figures file(s) of ended processes removed")
    notes += [f"skipped: {problem}" for problem in view.problems[:_MAX_PROBLEMS]]
    if len(view.problems) > _MAX_PROBLEMS:
        notes.append(f"skipped: {len(view.problems) - _MAX_PROBLEMS} more")
    return [""] + notes if notes else []


def _aligned(rows: list[tuple[str, ...]], right: frozenset = frozenset(_RIGHT)) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(width) if i in right else cell.ljust(width)
                      for i, (cell, width) in enumerate(zip(row, widths))).rstrip() for row in rows]


def _size(n: Optional[int]) -> str:
    return "-" if n is None else sizes.format_bytes(n)


def _number(n: Optional[int]) -> str:
    return "-" if n is None else str(n)


def _text(text: str) -> str:
    return shown(text, quote="")  # from outside: escaped


def _cut(text: str) -> str:
    text = shown(text, quote="", limit=10 * _JOB_WIDTH)
    return text if len(text) <= _JOB_WIDTH else text[:_JOB_WIDTH - 1] + "…"


# ---- JSON -------------------------------------------------------------------------------------------


def document(view: View) -> dict:
    """The view as `gpumem top --json` prints it (docs/monitoring.md lists the fields)."""
    return {
        "format": "gpumem-top/1",
        "time": view.time,
        "warn_at": view.warn_at,
        "run_dirs": view.run_dirs,
        "gpus": [{"index": g.index, "name": g.name, "uuid": g.uuid, "total_bytes": g.total, "used_bytes": g.used,
                  "error": g.error} for g in view.gpus],
        "processes": [_row_document(row) for row in view.rows],
        "stale_removed": view.stale_removed,
        "problems": view.problems,
    }


def _row_document(row: Row) -> dict:
    return {"gpu": row.gpu, "pid": row.pid, "own_pid": row.own_pid, "user": row.user, "job": row.job,
            "command": row.command, "used_bytes": row.used, "in_nvml": row.in_nvml,
            "gpumem": None if row.figures is None else _figures_document(row)}


def _figures_document(row: Row) -> dict:
    f = row.figures
    # Every published figure, named as its metric is (gpumem.monitoring.figures).
    published_figures = {figure.document: _copy(f[figure.key]) for figure in _figures.PUBLISHED}
    return {"device": f["index"], "no_limit": _no_limit(f), **published_figures, "scope": f["scope"],
            "sharing": bool(f.get("sharing")), "share_of_limit": row.share, "past_warn_at": row.past}


def _copy(value):
    return dict(value) if isinstance(value, dict) else value
