#!/usr/bin/env python3
"""Ways to get host memory a paused region's backup copies to at full speed, on this machine.

    python3 benchmarks/bench_pinning.py [GIB] [THREADS]     # default: 4 GiB, 8 threads

A pause with a backup needs host memory for the region's bytes; copies to pinned (page-locked)
memory run at the link's full rate, copies to ordinary memory do not. What each way costs, one JSON
line each, GiB/s over GIB:
  - host_alloc: cudaHostAlloc of the whole, in one call and in THREADS threads of a piece each;
  - register: ordinary memory (mmap), its pages first touched by THREADS threads (with and without
    transparent huge pages asked for), then cudaHostRegister, in one call and in THREADS threads;
  - staging: the CPU's copies, in THREADS threads, from pinned memory into fresh ordinary memory
    (huge pages asked) and back, the second half of a backup through a pinned staging buffer;
  - copies: device to host into pinned memory, into touched ordinary memory, into untouched
    ordinary memory.
Needs a CUDA GPU; calls the CUDA runtime torch loaded (ctypes), so no build is needed.
"""
import ctypes
import json
import sys
import threading
import time

GiB = 1 << 30
MADV_HUGEPAGE = 14


def runtime() -> ctypes.CDLL:
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    sys.exit("the CUDA runtime torch uses could not be loaded")


def checked(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: CUDA error {status}")


def in_threads(count: int, work) -> float:
    """Runs work(i) for i < count in as many threads; the seconds until all are done."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    import torch
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    size = int(gib * GiB) // (threads * (2 << 20)) * threads * (2 << 20)  # whole 2 MiB pages per thread
    piece = size // threads
    cuda = runtime()
    libc = ctypes.CDLL(None)
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    libc.memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    ordinary = lambda: libc.mmap(None, size, 3, 0x22, -1, 0)  # noqa: E731 - read/write, private anonymous
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    rate = lambda seconds: round(size / GiB / seconds, 2)  # noqa: E731
    print(json.dumps({"device": torch.cuda.get_device_name(), "gib": round(size / GiB, 2), "threads": threads}), flush=True)

    def copy_rate(host: int) -> float:
        start = time.perf_counter()
        checked(cuda.cudaMemcpy(ctypes.c_void_p(host), ctypes.c_void_p(device.data_ptr()), ctypes.c_size_t(size), 2),
                "cudaMemcpy")
        return rate(time.perf_counter() - start)

    # cudaHostAlloc, whole and in pieces.
    ptr = ctypes.c_void_p()
    start = time.perf_counter()
    checked(cuda.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(size), 0), "cudaHostAlloc")
    one = rate(time.perf_counter() - start)
    pinned_copy = copy_rate(ptr.value)
    pinned_again = copy_rate(ptr.value)
    # Staging: the CPU copies between that pinned memory and fresh ordinary memory, in threads.
    fresh = ordinary()
    libc.madvise(fresh, size, MADV_HUGEPAGE)
    to_fresh = in_threads(threads, lambda i: libc.memcpy(fresh + i * piece, ptr.value + i * piece, piece))
    from_ordinary = in_threads(threads, lambda i: libc.memcpy(ptr.value + i * piece, fresh + i * piece, piece))
    libc.munmap(fresh, size)
    checked(cuda.cudaFreeHost(ptr), "cudaFreeHost")
    print(json.dumps({"case": "staging", "pinned_to_fresh_in_threads": rate(to_fresh),
                      "ordinary_to_pinned_in_threads": rate(from_ordinary)}), flush=True)
    pieces = [ctypes.c_void_p() for _ in range(threads)]
    seconds = in_threads(threads, lambda i: checked(
        cuda.cudaHostAlloc(ctypes.byref(pieces[i]), ctypes.c_size_t(piece), 0), "cudaHostAlloc"))
    for p in pieces:
        checked(cuda.cudaFreeHost(p), "cudaFreeHost")
    print(json.dumps({"case": "host_alloc", "one_call": one, "in_threads": rate(seconds)}), flush=True)

    # Ordinary memory, touched by threads, then registered.
    for huge in (False, True):
        base = ordinary()
        if huge:
            libc.madvise(base, size, MADV_HUGEPAGE)
        touch = in_threads(threads, lambda i: libc.memset(base + i * piece, 0, piece))
        touched_copy = copy_rate(base)
        start = time.perf_counter()
        checked(cuda.cudaHostRegister(ctypes.c_void_p(base), ctypes.c_size_t(size), 0), "cudaHostRegister")
        register_one = rate(time.perf_counter() - start)
        registered_copy = copy_rate(base)
        checked(cuda.cudaHostUnregister(ctypes.c_void_p(base)), "cudaHostUnregister")
        register_threads = rate(in_threads(threads, lambda i: checked(
            cuda.cudaHostRegister(ctypes.c_void_p(base + i * piece), ctypes.c_size_t(piece), 0), "cudaHostRegister")))
        for i in range(threads):
            checked(cuda.cudaHostUnregister(ctypes.c_void_p(base + i * piece)), "cudaHostUnregister")
        print(json.dumps({"case": "register", "huge_pages_asked": huge, "touch_in_threads": rate(touch),
                          "register_one_call": register_one, "register_in_threads": register_threads,
                          "copy_to_touched_unpinned": touched_copy, "copy_to_registered": registered_copy}), flush=True)
        libc.munmap(base, size)

    fresh = ordinary()
    untouched = copy_rate(fresh)
    libc.munmap(fresh, size)
    print(json.dumps({"case": "copies", "to_pinned": pinned_copy, "to_pinned_again": pinned_again,
                      "to_untouched_unpinned": untouched}), flush=True)


if __name__ == "__main__":
    main()
