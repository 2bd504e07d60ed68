"""One member of a shared GPU's table, as a process of its own, driven by test_sharing_processes.py.

    python sharing_member.py [capacity_bytes]

Over a simulated device of its own (8 GiB unless told), it reads one command a line on stdin and
answers each with one JSON line on stdout; a failure is {"error": type, "message": text}. First it
prints {"ready": pid} (its pid in its own pid namespace).

    join PATH          share_join(0, PATH)
    floor N            share_set_floor(0, N) -> {"short": bytes}
    malloc N           -> {"ptr": address}
    free PTR
    mallocs N COUNT    COUNT times malloc N then free it -> {"seconds", "ok", "refusals": [texts]}
    empty_cache
    reserved           -> {"reserved": bytes}
    status             -> {"status": share_status(0)}
    churn SECONDS      malloc/free/status for that long -> {"rounds", "errors": [texts]}
    fork_exit          forks a child that exits normally (sys.exit(0): atexit runs)
                       -> {"child_exit": its status, or None if it had not ended in 20 s (then killed)}
    fork_sleep         forks a child that sleeps 1000 s -> {"child": its pid}
    leave              share_leave()
    exit               sys.exit(0)

The allocator goes at exit (an atexit handler drops it, as a program's exit destroys its
allocator): what a member's exit does to its slot runs as it would in a real program.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import time

from gpumem import _C

GiB = 1 << 30

sim = _C.SimAllocator(int(sys.argv[1]) if len(sys.argv) > 1 else 8 * GiB)
sim.set_growable(0, False)


def drop_allocator() -> None:
    global sim
    sim = None


atexit.register(drop_allocator)


def reply(value) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


def mallocs(size: int, count: int) -> dict:
    refusals, ok = [], 0
    start = time.monotonic()
    for _ in range(count):
        try:
            sim.free(sim.malloc(0, size))
            ok += 1
        except MemoryError as error:
            refusals.append(str(error))
    return {"seconds": time.monotonic() - start, "ok": ok, "refusals": refusals}


def churn(seconds: float) -> dict:
    errors, rounds = [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            sim.free(sim.malloc(0, 256 << 20))
            sim.share_status(0)
        except Exception as error:  # noqa: BLE001 - reported: the test wants to see it alive
            errors.append(f"{type(error).__name__}: {error}")
        rounds += 1
        time.sleep(0.005)
    return {"rounds": rounds, "errors": errors[:5]}


def fork_exit() -> dict:
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a normal exit: atexit handlers run, the allocator goes
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            return {"child_exit": os.waitstatus_to_exitcode(status)}
        time.sleep(0.01)
    os.kill(child, 9)
    os.waitpid(child, 0)
    return {"child_exit": None}


def fork_sleep() -> dict:
    child = os.fork()
    if child == 0:
        try:
            time.sleep(1000)
        finally:
            os._exit(0)
    return {"child": child}


def run(words: list[str]):
    command, args = words[0], words[1:]
    if command == "join":
        sim.share_join(0, args[0])
        return {"joined": True}
    if command == "floor":
        return {"short": sim.share_set_floor(0, int(args[0]))}
    if command == "malloc":
        return {"ptr": sim.malloc(0, int(args[0]))}
    if command == "free":
        sim.free(int(args[0]))
        return {}
    if command == "mallocs":
        return mallocs(int(args[0]), int(args[1]))
    if command == "empty_cache":
        sim.empty_cache(0)
        return {}
    if command == "reserved":
        return {"reserved": sim.reserved(0)}
    if command == "status":
        return {"status": sim.share_status(0)}
    if command == "churn":
        return churn(float(args[0]))
    if command == "fork_exit":
        return fork_exit()
    if command == "fork_sleep":
        return fork_sleep()
    if command == "leave":
        sim.share_leave()
        return {}
    if command == "exit":
        sys.exit(0)
    raise ValueError(f"unknown command {command!r}")


def main() -> None:
    reply({"ready": os.getpid()})
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            reply(run(words))
        except Exception as error:  # noqa: BLE001 - the test reads what failed
            reply({"error": type(error).__name__, "message": str(error)})


if __name__ == "__main__":
    main()
