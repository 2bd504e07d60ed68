"""The `gpumem` command (also `python -m gpumem`).

    gpumem info                                  devices, limits and this process's report
    gpumem run --limit 4GB -- python train.py    run a program under a limit
    gpumem replay SNAPSHOT --limit 4GB           would a recorded run fit under 4 GB?
    gpumem replay SNAPSHOT --min-limit           the smallest limit it fits under
    gpumem replay SNAPSHOT                       uncapped: its peaks, and the smallest limit
    gpumem replay ... --segments plain           ... with plain segments (default: growable)

Exit status: 0 on success (for replay: the trace fits); 1 when a replay does not fit (or, for
info, GPUMEM_LIMIT or GPUMEM_SEGMENTS is invalid); 2 for a usage error: bad arguments, a bad
limit, a snapshot that cannot be read. `run` passes the program's own exit status through (127 if
it is not found).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Callable, Optional, Sequence

from gpumem import _C, _segments

EXIT_FAILED = 1
EXIT_USAGE = 2
_ANY_TOTAL = 1 << 62  # checks a spec's syntax: every real device is smaller
_LIMIT_VARIABLE = "GPUMEM_LIMIT"
_SEGMENTS_VARIABLE = "GPUMEM_SEGMENTS"
_FORMS = _C.limit_forms.replace("%", "%%")  # argparse %-formats help texts


class _UsageError(Exception):
    """Reported as `gpumem: error: ...` with exit status 2."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.handler(args)
    except (_UsageError, ValueError, ImportError, OSError) as error:  # SnapshotError is a ValueError
        return _error(str(error))


# ---- arguments ----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpumem", description="A byte-level hard cap on PyTorch's CUDA memory.",
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="{info,run,replay}")

    info = verbs.add_parser("info", help="devices, limits and the current memory report",
                            description="Shows the visible CUDA devices, the limits GPUMEM_LIMIT sets, "
                                        "GPUMEM_SEGMENTS and this process's memory report. Without a GPU it "
                                        "says so and exits 0.")
    info.set_defaults(handler=_info)

    run = verbs.add_parser("run", help="run a program with a limit (GPUMEM_LIMIT)",
                           usage="gpumem run --limit LIMIT -- PROGRAM [ARGS ...]",
                           description="Runs PROGRAM with GPUMEM_LIMIT set, so gpumem caps its CUDA memory. "
                                       "The exit status is the program's.")
    run.add_argument("--limit", required=True, type=_checked(_assignments_spec),
                     help=f'"4GB", "50%%", or one per device "0:4GB,1:8GB". Forms: {_FORMS}')
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="PROGRAM [ARGS ...]")
    run.set_defaults(handler=_run)

    replay = verbs.add_parser("replay", help="replay a memory snapshot under a limit, or find the smallest limit",
                              description="Replays the allocations recorded in a snapshot from "
                                          "torch.cuda.memory._dump_snapshot through gpumem on a simulated "
                                          "device (no GPU needed). Exit status 0 if it fits, 1 if not.")
    replay.add_argument("snapshot", metavar="SNAPSHOT", help="a .pickle from torch.cuda.memory._dump_snapshot")
    mode = replay.add_mutually_exclusive_group()
    mode.add_argument("--limit", type=_checked(_spec), help=f"the limit to replay under. Forms: {_FORMS}")
    mode.add_argument("--min-limit", action="store_true", help="search for the smallest limit the trace fits under")
    replay.add_argument("--precision", type=_checked(_bytes), default=1 << 20,
                        help="how close --min-limit gets, in bytes or a size like 1MiB (default 1MiB)")
    replay.add_argument("--device", type=_checked(_device),
                        help="the device's trace to replay (default: the first with events)")
    replay.add_argument("--device-total", type=_checked(_bytes),
                        help="the device's memory, e.g. 80GB (default: as the snapshot records it, else twice "
                             "what the trace needs); percentages in --limit are of this")
    replay.add_argument("--segments", choices=(_segments.GROWABLE, _segments.PLAIN), default=_segments.GROWABLE,
                        help="the segments gpumem replays with: growable (the default, as on a GPU with CUDA "
                             "virtual memory management; 2 MiB pages) or plain (one cudaMalloc per segment)")
    replay.add_argument("--plot", metavar="PNG", help="draw allocated, reserved and the limit over time to this file")
    replay.set_defaults(handler=_replay)
    return parser


def _checked(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type: a ValueError becomes a usage error whose message is the error's."""
    def check(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(_without_prefix(str(error))) from None
    check.__name__ = parse.__name__.strip("_")
    return check


def _spec(text: str) -> str:
    _C.parse_limit(text, _ANY_TOTAL)
    return text


def _assignments_spec(text: str) -> str:
    for _, spec in _C.parse_limit_assignments(text):
        _spec(spec)
    return text


def _bytes(text: str) -> int:
    sizes = {_C.parse_limit(text, total) for total in (_ANY_TOTAL, _ANY_TOTAL >> 1)}
    size = sizes.pop()
    if sizes or size is None:
        raise ValueError(f"{text!r} is not a size in bytes (give e.g. 1048576 or 1MiB)")
    return size


def _device(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"device {text!r} is not a device index (0, 1, ...)")
    return int(text)


# ---- verbs --------------------------------------------------------------------------------------


def _info(args) -> int:
    from gpumem import reporting as report

    count = _C.device_count()
    env = os.environ.get(_LIMIT_VARIABLE)
    print(f"{_LIMIT_VARIABLE}: " + ("unset" if env is None else repr(env)))
    try:
        limits = _env_limits(env, count) if env is not None else {}
    except ValueError as error:
        print(f"{_LIMIT_VARIABLE} is invalid: {_without_prefix(str(error))}")
        limits = None
    segments_ok = _print_env_segments()
    if count == 0:
        print("no CUDA device was found")
    for d in range(count):
        free, total = _C.mem_info(d)
        under = f"; {_LIMIT_VARIABLE} sets {limits[d]}" if limits and d in limits else ""
        print(f"device {d}: {_device_name(d)}, {_C.format_bytes(total)} total, {_C.format_bytes(free)} free{under}")
    if count:
        print(report.collect())
    return EXIT_FAILED if limits is None or not segments_ok else 0


def _print_env_segments() -> bool:
    """Prints GPUMEM_SEGMENTS; False if it is set to something gpumem would refuse."""
    text = os.environ.get(_SEGMENTS_VARIABLE)
    print(f"{_SEGMENTS_VARIABLE}: " + ("unset" if text is None else repr(text)))
    if text is None:
        return True
    try:
        _segments.growable(text)
    except ValueError as error:
        print(f"{_SEGMENTS_VARIABLE} is invalid: {_without_prefix(str(error))}")
        return False
    return True


def _env_limits(text: str, count: int) -> dict[int, str]:
    """What GPUMEM_LIMIT sets on each visible device, as text; ValueError if it is invalid."""
    limits = {}
    for device, spec in _C.parse_limit_assignments(text):
        _spec(spec)  # the syntax, also where no device is visible
        for d in [d for d in (range(count) if device == -1 else [device]) if d < count]:
            nbytes = _C.parse_limit(spec, _C.mem_info(d)[1])
            limits[d] = "no limit" if nbytes is None else _C.format_bytes(nbytes)
    return limits


def _device_name(device: int) -> str:
    try:
        import torch

        return torch.cuda.get_device_name(device)
    except Exception:  # the name is decoration; the numbers come from gpumem
        return "CUDA device"


def _run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise _UsageError("run needs a program: gpumem run --limit 4GB -- python train.py")
    environment = {**os.environ, _LIMIT_VARIABLE: args.limit}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, environment)
    except FileNotFoundError:
        print(f"gpumem: error: program {command[0]!r} was not found", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"gpumem: error: program {command[0]!r} cannot be executed (permission denied)", file=sys.stderr)
        return 126
    return 0  # not reached: exec replaced this process


def _replay(args) -> int:
    from gpumem import replay, snapshot_file

    if args.plot:
        _require_matplotlib()
    snapshot = snapshot_file.load(args.snapshot)
    where = {"device": args.device, "total": args.device_total, "segments": args.segments}
    if args.limit is None and not args.min_limit:
        return _replay_uncapped(args, snapshot, where)
    if args.min_limit:
        found = replay.min_limit(snapshot, precision=args.precision, **where)
        _print_min_limit(found)
        if found.limit is None:
            return EXIT_FAILED
        result = None
        if args.plot:
            result = replay.replay(snapshot, found.limit, **where)
    else:
        result = replay.replay(snapshot, args.limit, **where)
        _print_replay(args.snapshot, result)
    if args.plot:
        result.report().plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0 if result is None or result.fits else EXIT_FAILED


def _replay_uncapped(args, snapshot, where) -> int:
    """No limit given: what the run needs, replayed without a cap, and the smallest cap it fits."""
    from gpumem import replay

    result = replay.replay(snapshot, None, **where)
    found = replay.min_limit(snapshot, precision=args.precision, **where) if result.fits else None
    _print_replay(args.snapshot, result)
    if found is not None:
        smallest = (f"{_C.format_bytes(found.limit)} ({found.limit} bytes; --min-limit tells how it was found)"
                    if found.limit is not None else "none fits in the simulated device")
        _print_rows([("smallest limit", smallest)])
    if args.plot:
        result.report().plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0 if result.fits else EXIT_FAILED


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
    size = _C.format_bytes
    original = ("from the trace's segment events" if r.original_reserved_source == "trace"
                else "segments at dump time: the trace has no segment events")
    rows = [
        ("snapshot", f"{path}, device {r.device}: {r.events_total} events"),
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
    from gpumem.replay import PAGE_SIZE

    if kind == _segments.GROWABLE:
        return f"growable ({_C.format_bytes(PAGE_SIZE)} pages mapped into reserved address ranges)"
    return "plain (one cudaMalloc per segment)"


def _failure_text(failure) -> str:
    where = ("a block alive before the trace began" if failure.event_index is None
             else f"event {failure.event_index} (time_us {failure.time_us})")
    return f"{where}, a request of {_C.format_bytes(failure.size)} ({failure.size} bytes): {failure.kind}"


def _print_min_limit(m) -> None:
    size = _C.format_bytes
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
    print(f"gpumem: error: {_without_prefix(message)}", file=sys.stderr)
    return EXIT_USAGE


def _without_prefix(message: str) -> str:
    return message[len("gpumem: "):] if message.startswith("gpumem: ") else message
