"""Host memory of the allocator's own bookkeeping over long loops, on the simulated device.

Prints the resident-memory growth of (1) `free(malloc(4096))` pairs on one stream and (2) steps of
64 mixed-size tensors on two streams with a peak reset each step, plain and growable segments.
Usage: python benchmarks/bench_host_memory.py [pairs, default 10_000_000] [steps, default 100_000]
"""
import os
import random
import sys

from gpumem import _C

MiB, GiB = 1 << 20, 1 << 30


def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main():
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    for name, page in (("plain", 0), ("growable", 2 * MiB)):
        sim = _C.SimAllocator(64 * GiB, page_size=page)
        for _ in range(1000):
            sim.free(sim.malloc(0, 4096))
        before = resident()
        for _ in range(pairs):
            sim.free(sim.malloc(0, 4096))
        print(f"{name:8s} {pairs:,} pairs of 4096 B on one stream: resident +{(resident() - before) / MiB:.1f} MiB")
        rng = random.Random(1)
        sizes = [int(2 ** rng.uniform(9, 26)) for _ in range(64)]
        streams = [i % 2 for i in range(64)]
        before = resident()
        for _ in range(steps):
            sim.reset_peak_stats(0)
            held = [sim.malloc(0, size, stream) for size, stream in zip(sizes, streams)]
            for addr in held:
                sim.free(addr)
        print(f"{name:8s} {steps:,} steps of 64 tensors on two streams, peaks reset each step: "
              f"resident +{(resident() - before) / MiB:.1f} MiB")
        sim.check_invariants(0)


if __name__ == "__main__":
    main()
