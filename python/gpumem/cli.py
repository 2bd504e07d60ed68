"""The `gpumem` command (also `python -m gpumem`).

    gpumem info                                  devices, limits and this process's report
    gpumem run --limit 4GB -- python train.py    run a program under a limit
    gpumem run --limit 4GB --scope process -- ...  ... on the whole process, as nvidia-smi counts it
    gpumem run --share -- python train.py        run a program that shares its GPU (GPUMEM_SHARE=on)
    gpumem run --floor 20GB -- python serve.py   ... and keeps 20 GB of it (GPUMEM_FLOOR)
    gpumem replay SNAPSHOT --limit 4GB           would a recorded run fit under 4 GB?
    gpumem replay SNAPSHOT --min-limit           the smallest limit it fits under
    gpumem replay SNAPSHOT                       uncapped: its peaks, and the smallest limit
    gpumem replay ... --segments plain           ... with plain segments (default: growable)
    gpumem replay ... --max-size 1GB             ... of a snapshot file past 256 MiB
    gpumem top                                   every process using a GPU, with gpumem's figures
    gpumem top --watch 2 | --json                ... refreshed every 2 s | as JSON for scripts

Exit status:
  0    success; for replay, the trace fits
  1    a replay does not fit
  2    anything else went wrong: bad arguments, a bad limit, a snapshot that cannot be read or is
       not one, an invalid GPUMEM_ setting in `gpumem info`, a
       --plot that could not be written (the replay's own result is printed all the same), for
       top NVML that cannot be used (nvidia-ml-py missing, no driver), an internal error
  130  interrupted (Ctrl-C)
  141  the output was cut off (the reader of a pipe went away, as in `gpumem info | head -1`)
`run` becomes the program (exec), so the exit status is the program's own; 127 if it is not
found, 126 if it cannot be executed.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import os
import re
import signal
import sys
from typing import Callable, Iterator, Optional, Sequence

import gpumem._C as _C
from gpumem.settings import (environment as _env, floors, limits as _limits, pressure_share, scope, segments,
                             sizes as _sizes)
from gpumem.settings.echo import bounded, shown, shown_path

EXIT_DOES_NOT_FIT = 1
EXIT_USAGE = 2
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # as a program that SIGPIPE ends
_FORMS = _C.limit_forms.replace("%", "%%")  # argparse %-formats help texts
_FLOOR_FORMS = floors.floor_forms().replace("%", "%%")
# The signals Python ignores at start-up, and an exec'd program would inherit ignored.
_IGNORED_BY_PYTHON = [getattr(signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, name)]
_SHELL = "/bin/sh"
# Errors after which execvp tries the next directory on PATH.
_NEXT_ON_PATH = {errno.EACCES, errno.ENOENT, errno.ENOTDIR, errno.ESTALE, errno.ENODEV, errno.ETIMEDOUT}
_DEVICE_INDEX = re.compile(r"[0-9]{1,9}")  # ASCII digits; int() would take "٣", and refuses 4301 digits


class _UsageError(Exception):
    """Reported as `gpumem: error: ...` with exit status 2."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        status = _main(argv)
        sys.stdout.flush()  # here, where a reader that has gone is caught, not as Python exits
        return status
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as error:  # noqa: BLE001: a bug in gpumem gets one line, not a traceback
        message = bounded(_message_of(error))
        print(f"gpumem: error: internal error: {type(error).__name__}: {message}", file=sys.stderr)
        return EXIT_USAGE


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.handler(args)
    except BrokenPipeError:
        raise
    except (_UsageError, ValueError, OSError) as error:  # SnapshotError is a ValueError
        return _error(str(error))


def _silence_stdout() -> None:
    # The reader has gone: what is still buffered must not fail again when Python exits.
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# ---- arguments ----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # argparse quotes some of the user's words as they came (an unknown flag, say): escaped here.
        super().error(bounded(message))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gpumem", description="A byte-level hard cap on PyTorch's CUDA memory.",
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="{info,run,replay,top}")

    info = verbs.add_parser("info", help="devices, limits and the current memory report",
                            description="Shows the visible CUDA devices, the limits GPUMEM_LIMIT sets, "
                                        "GPUMEM_SEGMENTS, GPUMEM_MEM_INFO and this process's memory report. "
                                        "Without a GPU it says so and exits 0. Exit status 2 if one of the "
                                        "variables is invalid (checked as a program under it would check it).")
    info.set_defaults(handler=_info)

    run = verbs.add_parser("run", help="run a program with a limit (GPUMEM_LIMIT), or sharing its GPU",
                           usage="gpumem run [--limit LIMIT] [--scope SCOPE] [--share] [--floor FLOOR] -- "
                                 "PROGRAM [ARGS ...]",
                           description="Runs PROGRAM with GPUMEM_LIMIT set (and GPUMEM_SCOPE, with --scope), so "
                                       "gpumem caps its CUDA memory; with --share (GPUMEM_SHARE=on) or --floor "
                                       "(GPUMEM_FLOOR), it shares its GPUs with the other gpumem processes on "
                                       "them (docs/usage.md, \"Sharing a GPU\"). At least one of --limit, "
                                       "--share and --floor is needed. The exit status is the program's (127: "
                                       "not found, 126: cannot be executed).")
    run.add_argument("--limit", type=_checked(_assignments_spec),
                     help=f'"4GB", "50%%", or one per device "0:4GB,1:8GB". Forms: {_FORMS}')
    run.add_argument("--scope", type=_checked(scope.scope),
                     help=f'what the limit bounds: {scope.FORMS} (the whole process, as nvidia-smi counts it); '
                          "default: GPUMEM_SCOPE's, else allocator")
    run.add_argument("--share", action="store_true",
                     help="share the GPUs with the other gpumem processes on them: give back free cache when "
                          "they ask, and ask them (GPUMEM_SHARE=on)")
    run.add_argument("--floor", type=_checked(_floor_spec),
                     help='memory the other gpumem processes leave this one: "20GB", or one per device '
                          f'"0:20GB,1:8GB"; implies --share (GPUMEM_FLOOR). Forms: {_FLOOR_FORMS}')
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="PROGRAM [ARGS ...]")
    run.set_defaults(handler=_run)

    replay = verbs.add_parser("replay", help="replay a memory snapshot under a limit, or find the smallest limit",
                              description="Replays the allocations recorded in a snapshot from "
                                          "torch.cuda.memory._dump_snapshot through gpumem on a simulated "
                                          "device (no GPU needed). Exit status 0 if it fits, 1 if not, 2 for "
                                          "an error (a --plot that could not be written among them).")
    replay.add_argument("snapshot", metavar="SNAPSHOT", help="a .pickle from torch.cuda.memory._dump_snapshot")
    mode = replay.add_mutually_exclusive_group()
    mode.add_argument("--limit", type=_checked(_spec), help=f"the limit to replay under. Forms: {_FORMS}")
    mode.add_argument("--min-limit", action="store_true", help="search for the smallest limit the trace fits under")
    replay.add_argument("--precision", type=_checked(_positive_size("1MiB")), default=1 << 20,
                        help="how close --min-limit gets, in bytes or a size like 1MiB (default 1MiB)")
    replay.add_argument("--device", type=_checked(_device),
                        help="the device's trace to replay (default: the first with events)")
    replay.add_argument("--device-total", type=_checked(_positive_size("80GB")),
                        help="the device's memory, e.g. 80GB (default: as the snapshot records it, else twice "
                             "what the trace needs); percentages in --limit are of this")
    replay.add_argument("--segments", choices=(segments.GROWABLE, segments.PLAIN), default=segments.GROWABLE,
                        help="the segments gpumem replays with: growable (the default, as on a GPU with CUDA "
                             "virtual memory management; 2 MiB pages) or plain (one cudaMalloc per segment)")
    replay.add_argument("--plot", metavar="PNG", help="draw allocated, reserved and the limit over time to this file")
    replay.add_argument("--max-size", type=_checked(_positive_size("1GB")), metavar="SIZE",
                        help="the largest snapshot file to read, e.g. 1GB (default 256MiB); reading one takes "
                             "up to 48 bytes of memory for each byte of it")
    replay.set_defaults(handler=_replay)
    _add_top(verbs)
    return parser


_TOP_DESCRIPTION = """\
Every process on this machine that uses a GPU, as NVML (the driver) lists it, one row per process
and GPU: the GPU (NVML's index: every GPU of the machine), pid, user, job, and USED, the memory
the driver counts for the process (its CUDA context and every allocator's memory). For processes
under gpumem, from the figures each one publishes (GPUMEM_PUBLISH, on by default) in the run
directory: LIMIT (none: no limit), ALLOCATED, RESERVED, PEAK (peak reserved), OOMS (out-of-memory
errors, all cases; --json has them by case) and CAP, reserved as a share of the limit. A row
marked ! has reserved --warn-at of its limit or more. Figures files of processes that ended are
left out and removed.

Run directories: GPUMEM_RUN_DIR if set, else every user's /tmp/gpumem-<uid> (run as root to read
them all; another user sees the driver's rows of others' processes only).

Containers: NVML names processes by their pid on the host. On the host, with the run directory
mounted into the containers (and GPUMEM_RUN_DIR set there), a container's gpumem process is
joined to its host pid (NOTE says its pid inside). Inside a container the driver's rows keep host
pids that cannot be matched, and the container's own gpumem processes appear as rows of their
own, noted "not in NVML's list".

Needs nvidia-ml-py (pip install nvidia-ml-py, or gpumem[top]); without it, or without a driver,
exit status 2. docs/monitoring.md describes the files and the JSON."""


def _add_top(verbs) -> None:
    top = verbs.add_parser("top", help="every process using a GPU, with gpumem's figures (needs nvidia-ml-py)",
                           description=_TOP_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--watch", nargs="?", const=2.0, type=_checked(_seconds), metavar="SECONDS",
                     help="show it again every SECONDS (default 2) until Ctrl-C (exit status 130)")
    top.add_argument("--json", action="store_true",
                     help="one JSON document on one line (one per refresh with --watch)")
    top.add_argument("--warn-at", type=_checked(_share), metavar="SHARE",
                     help="mark processes whose reserved has reached this share of their limit, in (0, 1] "
                          "(default: GPUMEM_WARN_AT, else 0.85)")
    top.set_defaults(handler=_top)


def _checked(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type: a ValueError becomes a usage error whose message is the error's."""
    def check(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(bounded(_without_prefix(str(error)))) from None
    check.__name__ = parse.__name__.strip("_")
    return check


def _spec(text: str) -> str:
    _limits.check_syntax(text)
    return text


def _assignments_spec(text: str) -> str:
    try:
        _env.resolve_limit(text)  # the check the program's GPUMEM_LIMIT gets
    except _env.SettingError as error:
        value = shown(text, quote='"')  # as the limit grammar quotes a limit
        raise ValueError(f"bad limit {value}: {error.reason}") from None
    return text


def _floor_spec(text: str) -> str:
    try:
        _env.floor({floors.FLOOR_VARIABLE: text})  # the check the program's GPUMEM_FLOOR gets
    except _env.SettingError as error:
        value = shown(text, quote='"')  # as the limit grammar quotes a limit
        raise ValueError(f"bad floor {value}: {error.reason}") from None
    return text


def _positive_size(example: str) -> Callable[[str], int]:
    def size(text: str) -> int:
        # A percentage or fraction would depend on the device: it comes out differently on two.
        try:
            sizes = {_limits.parse(text, total) for total in (_limits.ANY_TOTAL, _limits.ANY_TOTAL >> 1)}
        except ValueError:
            sizes = set()
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"{shown(text)} is not a positive size in bytes (give e.g. {example})")
        return sizes.pop()
    return size


def _seconds(text: str) -> float:
    try:
        seconds = float(text) if text.strip().isascii() and len(text) <= 32 else None
    except ValueError:
        seconds = None
    if seconds is None or not 0.1 <= seconds <= 86400:
        raise ValueError(f"{shown(text)} is not a number of seconds from 0.1 to 86400")
    return seconds


def _share(text: str) -> float:
    try:
        return pressure_share.share_of_text(text)
    except ValueError:
        raise ValueError(f"{shown(text)} is not {pressure_share.SHARE_FORMS}") from None


def _device(text: str) -> int:
    if _DEVICE_INDEX.fullmatch(text) is None:
        raise ValueError(f"device {shown(text)} is not a device index (0, 1, ... in ASCII digits)")
    return int(text)


# ---- verbs --------------------------------------------------------------------------------------


def _info(args) -> int:
    from gpumem.monitoring import reporting as report

    count = _C.device_count()
    limits = _print_env_limit(count)
    settings_ok = [_print_env_setting(variable, read) for variable, read in _env.SETTINGS]
    floors = _env_floors(count)
    if count == 0:
        print("no CUDA device was found")
    for d in range(count):
        free, total = _C.mem_info(d)
        under = f"; {_env.VARIABLE} sets {limits[d]}" if limits and d in limits else ""
        print(f"device {d}: {_device_name(d)}, {_sizes.format_bytes(total)} total, {_sizes.format_bytes(free)} free{under}")
        if floors and floors[d] is not None:
            print(f"  floor: {_sizes.format_bytes(floors[d])} ({floors.FLOOR_VARIABLE}), left by the other gpumem "
                  "processes on this GPU")
    if count:
        print(report.collect())
    return EXIT_USAGE if limits is None or floors is None or not all(settings_ok) else 0


def _print_env_limit(count: int) -> Optional[dict[int, str]]:
    """Prints GPUMEM_LIMIT; returns what it sets on each visible device it names, as text, or None
    if a program under it would be stopped (its syntax where no device is visible, else what it
    means on these devices, as gpumem applies it at CUDA init)."""
    text = os.environ.get(_env.VARIABLE)
    print(f"{_env.VARIABLE}: " + ("unset" if text is None else shown(text)))
    if text is None:
        return {}
    try:
        limits = _env.resolve_limit(text, [_C.device_total(d) for d in range(count)] if count else None)
    except _env.SettingError as error:
        print(f"{_env.VARIABLE} is invalid: {error.reason}")
        return None
    named = {device for device, _ in _C.parse_limit_assignments(text)}
    return {d: "no limit" if nbytes is None else _sizes.format_bytes(nbytes)
            for d, nbytes in enumerate(limits or []) if -1 in named or d in named}


def _env_floors(count: int) -> Optional[list[Optional[int]]]:
    """GPUMEM_FLOOR on these devices, as a program under it applies it at CUDA init: each device's
    floor in bytes (None: none), [] where it is unset or there is no device; None if a program
    under it would be stopped, said in one line. A bad syntax, or a bad GPUMEM_LIMIT, is reported
    with the settings, and gives []."""
    text = os.environ.get(floors.FLOOR_VARIABLE)
    if text is None or count == 0:
        return []
    totals = [_C.device_total(d) for d in range(count)]
    try:
        _env.floor()
        caps = _env.resolve_limit(os.environ[_env.VARIABLE], totals) if _env.VARIABLE in os.environ else None
    except _env.SettingError:
        return []
    limits = [total if cap is None else cap for total, cap in zip(totals, caps or [None] * count)]
    try:
        return floors.resolve_floors(text, totals, limits)
    except floors.FloorSettingError as error:
        print(f"{floors.FLOOR_VARIABLE} is invalid on device {error.device}: {error.reason}")
        return None


def _print_env_setting(variable: str, read: Callable[[], object]) -> bool:
    """Prints a setting's variable (GPUMEM_METRICS_ADDR with the address the endpoint binds); False
    if it is set to something gpumem would refuse."""
    text = os.environ.get(variable)
    line = f"{variable}: " + ("unset" if text is None else shown(text))
    try:
        value = read()
    except _env.SettingError as error:
        print(f"{line}\n{error.variable} is invalid: {error.reason}")
        return False
    if variable == _env.METRICS_ADDR_VARIABLE and text is not None:
        line += f" (the metrics endpoint listens on {value})"
    print(line)
    return True


def _device_name(device: int) -> str:
    try:
        import torch

        return torch.cuda.get_device_name(device)
    except Exception:  # the name is decoration; the numbers come from gpumem
        return "CUDA device"


def _run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.limit is None and not args.share and args.floor is None:
        raise _UsageError("run needs --limit, --share or --floor: gpumem run --limit 4GB -- python train.py, "
                          "or gpumem run --share -- python train.py")
    if not command:
        raise _UsageError("run needs a program: gpumem run --limit 4GB -- python train.py")
    given = {_env.VARIABLE: args.limit, _env.SCOPE_VARIABLE: args.scope, floors.FLOOR_VARIABLE: args.floor,
             floors.SHARE_VARIABLE: "on" if args.share else None}
    environment = {**os.environ, **{variable: value for variable, value in given.items() if value is not None}}
    sys.stdout.flush()
    sys.stderr.flush()
    with _signals_as_a_shell_leaves_them():
        path, error = _exec(command, environment)
    return _exec_failed(command[0], path, error)


@contextlib.contextmanager
def _signals_as_a_shell_leaves_them() -> Iterator[None]:
    """Python ignores SIGPIPE and SIGXFSZ (it raises on a broken pipe instead), and a signal ignored
    stays ignored across exec: a program would not die on a closed pipe, as it does from a shell.
    Put back if the exec fails, for gpumem's own error message."""
    saved = {signum: signal.signal(signum, signal.SIG_DFL) for signum in _IGNORED_BY_PYTHON}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _exec(command: list[str], environment: dict[str, str]) -> tuple[str, OSError]:
    """Replaces this process with `command`, found as execvp finds it (PATH, unless the name has a
    slash). Returns only if no candidate could be started: the path that came closest, and why."""
    name, failure = command[0], None
    for path in _candidates(name, environment.get("PATH", os.defpath)):
        try:
            _execve(path, command, environment)
        except OSError as error:
            if error.errno not in _NEXT_ON_PATH:
                return path, error
            if failure is None or _closeness(path, error) > _closeness(*failure):
                failure = (path, error)
    return failure or (name, FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT)))


def _candidates(name: str, search_path: str) -> list[str]:
    if not name:
        return []
    if "/" in name:
        return [name]
    return [os.path.join(directory or os.curdir, name) for directory in search_path.split(os.pathsep)]


def _execve(path: str, command: list[str], environment: dict[str, str]) -> None:
    try:
        os.execve(path, command, environment)
    except OSError as error:
        if error.errno != errno.ENOEXEC:
            raise
        # A file the kernel cannot start (a script without #!) is a shell script, as execvp, env,
        # nice and timeout take it.
        os.execve(_SHELL, [_SHELL, path, *command[1:]], environment)


def _closeness(path: str, error: OSError) -> int:
    """Which failure to report: a file found but not runnable over one not found."""
    return 2 if error.errno == errno.EACCES else 1 if os.path.exists(path) else 0


def _exec_failed(name: str, path: str, error: OSError) -> int:
    if error.errno == errno.ENOENT and not os.path.exists(path):
        print(f"gpumem: error: program {shown_path(name)} was not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    program = shown_path(name) if path == name else f"{shown_path(name)} ({shown_path(path)})"
    if error.errno == errno.ENOENT:  # the file is there: what its #! line names is not
        reason = "the interpreter its #! line names was not found"
    elif os.path.isdir(path):
        reason = "it is a directory"
    else:
        reason = error.strerror or str(error)
    print(f"gpumem: error: program {program} cannot be executed: {reason}", file=sys.stderr)
    return EXIT_CANNOT_EXECUTE


def _top(args) -> int:
    from gpumem.monitoring import nvml as _nvml, published, top

    warn_at = args.warn_at if args.warn_at is not None else _env.warn_at()
    run_dirs = published.run_dirs(_env.run_dir())
    try:
        with top.open_nvml() as nvml:
            return top.run(nvml, run_dirs, top.WARN_AT if warn_at is None else warn_at, as_json=args.json,
                           every=args.watch)
    except _nvml.NvmlError as error:
        raise _UsageError(str(error)) from None


def _replay(args) -> int:
    from gpumem.trace import replay, snapshot_file

    if args.plot:
        _require_matplotlib()
    snapshot = snapshot_file.load(args.snapshot, max_size=args.max_size or snapshot_file.MAX_FILE_SIZE)
    where = {"device": args.device, "total": args.device_total, "segments": args.segments}
    if args.limit is None and not args.min_limit:
        return _replay_uncapped(args, snapshot, where)
    if args.min_limit:
        found = replay.min_limit(snapshot, precision=args.precision, **where)
        _print_min_limit(found)
        if found.limit is None:
            return EXIT_DOES_NOT_FIT
        return _plotted(replay.replay(snapshot, found.limit, **where), args.plot, 0) if args.plot else 0
    result = replay.replay(snapshot, args.limit, **where)
    _print_replay(args.snapshot, result)
    return _plotted(result, args.plot, 0 if result.fits else EXIT_DOES_NOT_FIT)


def _replay_uncapped(args, snapshot, where) -> int:
    """No limit given: what the run needs, replayed without a cap, and the smallest cap it fits."""
    from gpumem.trace import replay

    result = replay.replay(snapshot, None, **where)
    found = replay.min_limit(snapshot, precision=args.precision, **where) if result.fits else None
    _print_replay(args.snapshot, result)
    if found is not None:
        smallest = (f"{_sizes.format_bytes(found.limit)} ({found.limit} bytes; --min-limit tells how it was found)"
                    if found.limit is not None else "none fits in the simulated device")
        _print_rows([("smallest limit", smallest)])
    return _plotted(result, args.plot, 0 if result.fits else EXIT_DOES_NOT_FIT)


def _plotted(result, path: Optional[str], status: int) -> int:
    """Draws the replay to `path` (when given); the exit status: `status`, the replay's verdict,
    unless the plot failed (2: the command did not do all it was asked; the verdict stays printed)."""
    if path is None:
        return status
    try:
        result.report().plot(path)
    except Exception as error:  # noqa: BLE001: matplotlib's errors are many; the replay's output stands
        reason = error.strerror if isinstance(error, OSError) and error.strerror else _without_prefix(str(error))
        print(f"gpumem: error: the plot could not be written to {shown_path(path)}: {bounded(reason)}",
              file=sys.stderr)
        return EXIT_USAGE
    print(f"plot written to {bounded(path)}")
    return status


def _require_matplotlib() -> None:
    # Checked before the replay, which can take a while, rather than after it.
    if importlib.util.find_spec("matplotlib") is None:
        raise _UsageError("--plot needs matplotlib: pip install matplotlib")


# ---- output -------------------------------------------------------------------------------------

_SOURCES = {
    "snapshot": "as the snapshot records it",
    "given": "as --device-total gives it",
    "trace": "twice what the trace needs; --device-total sets the real size",
}


def _print_replay(path: str, r) -> None:
    size = _sizes.format_bytes
    original = ("from the trace's segment events" if r.original_reserved_source == "trace"
                else "segments at dump time: the trace has no segment events")
    rows = [
        ("snapshot", f"{bounded(path)}, device {r.device}: {r.events_total} events"),
        ("replayed", f"{r.allocs_replayed} allocs, {r.frees_replayed} frees, "
                     f"{r.initial_blocks} blocks alive before the trace"),
        ("simulated device", f"{size(r.capacity)} ({_SOURCES[r.capacity_source]})"),
        ("segments", _segments_text(r.segments)),
        ("limit", f"{size(r.limit)} ({r.limit} bytes)" if r.limit < r.capacity else "none (uncapped)"),
        ("result", "fits" if r.fits else f"FAILED: {_failure_text(r.failure)}"),
        ("peak allocated", size(r.peak_allocated)),
        ("peak reserved", f"{size(r.peak_reserved)} (under gpumem)"),
        ("original reserved", f"{size(r.original_peak_reserved)} (peak of the recorded run, {original})"),
        ("inactive split peak", size(r.inactive_split_peak)),
        ("largest free block", f"{size(r.largest_free_block)} (at the end)"),
    ]
    if r.original_ooms:
        rows.append(("original OOMs", f"{r.original_ooms} (out-of-memory errors in the recorded run)"))
    _print_rows(rows)
    if not r.fits:
        print(f"\n{r.failure.message}")


def _segments_text(kind: str) -> str:
    from gpumem.trace.replay import PAGE_SIZE

    if kind == segments.GROWABLE:
        return f"growable ({_sizes.format_bytes(PAGE_SIZE)} pages mapped into reserved address ranges)"
    return "plain (one cudaMalloc per segment)"


def _failure_text(failure) -> str:
    where = ("a block alive before the trace began" if failure.event_index is None
             else f"event {failure.event_index} (time_us {failure.time_us})")
    return f"{where}, a request of {_sizes.format_bytes(failure.size)} ({failure.size} bytes): {failure.kind}"


def _print_min_limit(m) -> None:
    size = _sizes.format_bytes
    if m.limit is None:
        _print_rows([("min limit", f"none: the trace does not fit even in the simulated device "
                                        f"({size(m.capacity)}); give a larger --device-total")])
        return
    _print_rows([
        ("min limit", f"{size(m.limit)} ({m.limit} bytes): fits; {size(m.precision)} less fails"),
        ("segments", _segments_text(m.segments)),
        ("peak requested", f"{size(m.peak_allocated)} ({m.peak_allocated} bytes: the trace's live requests, "
                           "each rounded up to 512 bytes)"),
        ("ratio", f"{m.ratio:.3f} x peak requested"),
        ("replays", str(m.replays)),
    ])
    print("(found by bisection; fitting is not monotone in the limit, so a lower limit may fit too)")


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


def _error(message: str) -> int:
    print(f"gpumem: error: {bounded(_without_prefix(message))}", file=sys.stderr)
    return EXIT_USAGE


def _message_of(error: BaseException) -> str:
    try:
        return str(error) or "(no message)"
    except Exception:  # noqa: BLE001: an exception whose text cannot be made
        return "(its message cannot be shown)"


def _without_prefix(message: str) -> str:
    return message[len("gpumem: "):] if message.startswith("gpumem: ") else message
