#!/usr/bin/env python3
"""Many Python threads allocating at once, each on its own stream, under a cap: operations per second,
one allocator per process.

Each of --threads threads (default 8) runs on its own torch.cuda.Stream. One operation: draw a size
(log-uniform from 512 B to 64 MiB; thread i's sizes from seed 42 + i, the same in every process),
torch.empty that many uint8 bytes on the GPU, fill_ it, read its last byte back (.item(), which
waits for that thread's stream only) and check it. Each thread keeps at most --live tensors
(default 8): before an allocation that would pass that, it drops one of its tensors at random.
torch lets go of the GIL inside its operations, so the threads' allocator calls overlap.

A warm-up window of --warm-up seconds, then --runs windows of --duration seconds. In a window all
threads start at one barrier and stop at one deadline; ops/s = every thread's operations / (the
last thread's end - the start). The figure is the median over the windows.

Both allocators run under --cap (default 6GiB), capped as part 4 of docs/benchmarks.md caps them:
gpumem with gpumem.set_limit, native with torch.cuda.set_per_process_memory_fraction. After the
windows, gpumem's peak reserved bytes must be within its limit: if they passed it, the JSON is
written and the process exits 1. Native's peak is reported.

    python3 benchmarks/bench_threads.py --allocator gpumem|native [--threads 8] [--no-alloc] [--out FILE]

--no-alloc gives each thread one 64 MiB buffer, made before the windows, and takes each operation's
tensor as a view of its first bytes instead of from torch.empty: the same operations with no
allocator work (nothing is handed out or freed), the ceiling over any allocator's figure.

A failing thread (an out-of-memory error, a wrong byte read back) stops the process with its
error; a thread that does not finish within a minute of its deadline is taken as a hang (exit 2).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import sys
import threading
import time

from common import apply_cap, check_allocator, log, median, select_allocator, write_json

MiB = 1 << 20
HANG_S = 60  # past a window's deadline, or waiting at its start: a thread this late is stuck


class Worker:
    """One thread's stream, sizes and live tensors; they carry over from window to window."""

    def __init__(self, index: int, stream, live_most: int):
        self.index = index
        self.stream = stream
        self.live_most = live_most
        self.rng = random.Random(42 + index)
        self.live: list = []
        self.buffer = None  # --no-alloc: the tensor every operation's tensor is a view of
        self.ops = 0
        self.end = 0.0
        self.error: BaseException | None = None

    def window(self, start: threading.Barrier, deadline: float, stop: threading.Event) -> None:
        import torch

        empty, uint8, device = torch.empty, torch.uint8, torch.device("cuda", 0)
        if self.buffer is not None:
            buffer = self.buffer

            def empty(size, dtype, device):  # the view has the buffer's dtype and device
                return buffer[:size]
        rng, live, low, high = self.rng, self.live, math.log(512), math.log(64 * MiB)
        self.ops = 0
        try:
            start.wait(HANG_S)
            with torch.cuda.stream(self.stream):
                while not stop.is_set() and time.perf_counter() < deadline:
                    if len(live) >= self.live_most:
                        del live[rng.randrange(len(live))]
                    value = self.ops & 255
                    tensor = empty(int(math.exp(rng.uniform(low, high))), dtype=uint8, device=device)
                    tensor.fill_(value)
                    read = tensor[-1].item()  # waits for this stream
                    if read != value:
                        raise RuntimeError(f"read back {read} from a tensor filled with {value}")
                    live.append(tensor)
                    self.ops += 1
        except BaseException as error:  # reported by the main thread; the others stop too
            self.error = error
            stop.set()
        self.end = time.perf_counter()


def window(workers: list[Worker], seconds: float) -> float:
    """Runs every worker for `seconds` from one start; all workers' operations per second."""
    start = threading.Barrier(len(workers) + 1)
    stop = threading.Event()
    deadline = time.perf_counter() + seconds
    threads = [threading.Thread(target=w.window, args=(start, deadline, stop), daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        start.wait(HANG_S)
    except threading.BrokenBarrierError:
        stop.set()
    began = time.perf_counter()
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()) + HANG_S)
        if t.is_alive():
            print(f"bench_threads.py: a thread is still running {HANG_S} s after its window's end: "
                  "stopping (a hang?)", file=sys.stderr, flush=True)
            os._exit(2)
    failed = [w for w in workers if w.error is not None]
    if failed:
        w = failed[0]
        first_line = (str(w.error).strip().splitlines() or [""])[0]
        sys.exit(f"bench_threads.py: thread {w.index} failed: {type(w.error).__name__}: {first_line}")
    return sum(w.ops for w in workers) / (max(w.end for w in workers) - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allocator", choices=("gpumem", "native"), required=True)
    parser.add_argument("--threads", type=int, default=8, help="threads, one stream each (default 8)")
    parser.add_argument("--live", type=int, default=8, help="most live tensors per thread (default 8)")
    parser.add_argument("--cap", default="6GiB", help="the cap on reserved memory (default 6GiB)")
    parser.add_argument("--warm-up", type=float, default=1.0, help="seconds of warm-up (default 1)")
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per timed window (default 1)")
    parser.add_argument("--runs", type=int, default=3, help="timed windows (default 3)")
    parser.add_argument("--no-alloc", action="store_true",
                        help="views of one buffer per thread instead of torch.empty: no allocator work")
    parser.add_argument("--out", default="", help="write the JSON result here too")
    args = parser.parse_args()
    if not (1 <= args.threads <= 256 and 1 <= args.live <= 1024 and 1 <= args.runs <= 100):
        parser.error("--threads wants 1 to 256, --live 1 to 1024, --runs 1 to 100")
    if not (0 <= args.warm_up <= 600 and 0 < args.duration <= 600):
        parser.error("--warm-up wants 0 to 600 seconds, --duration more than 0 and at most 600")
    import torch  # before gpumem, only to say plainly that there is no GPU; CUDA is not started

    if not torch.cuda.is_available():
        sys.exit("bench_threads.py: no CUDA GPU here; this benchmark needs one")
    select_allocator(args.allocator)
    check_allocator(args.allocator)
    from gpumem import _C

    cap = _C.parse_limit(args.cap, 1 << 62)
    limit = apply_cap(args.allocator, cap)
    workers = [Worker(i, torch.cuda.Stream(), args.live) for i in range(args.threads)]
    if args.no_alloc:
        for w in workers:
            with torch.cuda.stream(w.stream):
                w.buffer = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    log(f"{args.allocator}: {args.threads} threads, warm-up {args.warm_up} s, {args.runs} x {args.duration} s")
    gc.disable()  # a collection in a window would be noise, not allocator cost
    if args.warm_up:
        window(workers, args.warm_up)
    runs = [window(workers, args.duration) for _ in range(args.runs)]
    gc.enable()
    for w in workers:
        w.live.clear()
        w.buffer = None
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    record = {
        "allocator": args.allocator, "no_alloc": args.no_alloc, "threads": args.threads, "live_per_thread": args.live,
        "sizes": "log-uniform 512 B to 64 MiB, thread i's from seed 42 + i",
        "warm_up_s": args.warm_up, "duration_s": args.duration, "runs": args.runs,
        "ops_per_s": median(runs), "ops_per_s_runs": runs,
        "cap": cap, "limit": limit, "peak_reserved": torch.cuda.max_memory_reserved(),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "device_allocs": stats.get("num_device_alloc", -1), "alloc_retries": stats.get("num_alloc_retries", -1),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
    }
    if args.allocator == "gpumem":
        import gpumem

        record["gpumem_peak_reserved"] = gpumem.stats()["reserved_bytes.all.peak"]
    record["cap_held"] = max(record["peak_reserved"], record.get("gpumem_peak_reserved", 0)) <= limit
    write_json(args.out, record)
    if args.allocator == "gpumem" and not record["cap_held"]:
        sys.exit(f"bench_threads.py: gpumem's peak reserved ({record['peak_reserved']} B) passed its limit ({limit} B)")


if __name__ == "__main__":
    main()
