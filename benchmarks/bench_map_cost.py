#!/usr/bin/env python3
"""What growing and shrinking a growable segment costs on this GPU.

    python3 benchmarks/bench_map_cost.py            # through gpumem: µs per 2 MiB page, 1 and 4 GiB
    python3 benchmarks/bench_map_cost.py --driver   # the driver's calls alone, per 256 MiB chunk

Through gpumem: one 1 GiB and one 4 GiB tensor made on an empty cache (every page mapped then) and
given back with empty_cache (every page unmapped), in microseconds per page. --driver: the CUDA
driver's virtual memory calls that a growth and a release are made of (cuMemCreate, cuMemMap,
cuMemSetAccess; cuMemUnmap, cuMemRelease), each timed over 60 % of the device's memory in 256 MiB
chunks (the chunk a large growth maps in), in ms per GiB, the way docs/design.md ("Handing memory
over") reads them: once for plain allocations and once for allocations exportable as POSIX file
descriptors (what gpumem makes where the driver allows, so that tensors can be sent to other
processes). Needs a CUDA GPU with virtual memory management.
"""
import ctypes
import json
import sys
import time

PAGE = 2 << 20
CHUNK = 256 << 20


def through_gpumem() -> dict:
    import gpumem
    import torch
    gpumem.enable()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    if gpumem.get_segments() != "growable":
        sys.exit("gpumem uses plain segments on this device: nothing to measure")
    result = {"segments": gpumem.get_segments()}
    for gib in (1, 4):
        pages = (gib << 30) // PAGE
        start = time.perf_counter()
        tensor = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
        mapped = time.perf_counter() - start
        del tensor
        start = time.perf_counter()
        torch.cuda.empty_cache()
        unmapped = time.perf_counter() - start
        result[f"{gib}GiB"] = {"map_us_per_page": mapped / pages * 1e6, "unmap_us_per_page": unmapped / pages * 1e6}
    return result


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def by_driver(exportable: bool) -> dict:
    cu = ctypes.CDLL("libcuda.so.1")

    def check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} returned CUDA error {status}")

    check(cu.cuInit(0), "cuInit")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check(cu.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    chunks = int(0.6 * total.value) // CHUNK
    prop = _Prop(type=1, requestedHandleTypes=1 if exportable else 0, location=_Location(1, 0))  # pinned, device 0
    access = _Access(location=_Location(1, 0), flags=3)  # read and write
    base = ctypes.c_uint64()
    check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(chunks * CHUNK), ctypes.c_size_t(0),
                                 ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
    seconds = dict.fromkeys(("create", "map", "set_access", "unmap", "release"), 0.0)
    handles = []

    def timed(name: str, call, *args) -> None:
        start = time.perf_counter()
        check(call(*args), name)
        seconds[name] += time.perf_counter() - start

    for i in range(chunks):
        handle = ctypes.c_uint64()
        at = ctypes.c_uint64(base.value + i * CHUNK)
        timed("create", cu.cuMemCreate, ctypes.byref(handle), ctypes.c_size_t(CHUNK), ctypes.byref(prop), ctypes.c_uint64(0))
        timed("map", cu.cuMemMap, at, ctypes.c_size_t(CHUNK), ctypes.c_size_t(0), handle, ctypes.c_uint64(0))
        timed("set_access", cu.cuMemSetAccess, at, ctypes.c_size_t(CHUNK), ctypes.byref(access), ctypes.c_size_t(1))
        handles.append(handle)
    for i, handle in enumerate(handles):
        timed("release", cu.cuMemRelease, handle)  # the mapping keeps the memory: this frees nothing yet
        timed("unmap", cu.cuMemUnmap, ctypes.c_uint64(base.value + i * CHUNK), ctypes.c_size_t(CHUNK))
    check(cu.cuMemAddressFree(base, ctypes.c_size_t(chunks * CHUNK)), "cuMemAddressFree")
    gib = chunks * CHUNK / (1 << 30)
    return {"exportable": exportable, "chunk_mib": CHUNK >> 20, "chunks": chunks, "gib": round(gib, 2),
            "ms_per_gib": {name: round(s / gib * 1e3, 3) for name, s in seconds.items()},
            "ms_total": {name: round(s * 1e3, 1) for name, s in seconds.items()}}


def main() -> None:
    try:
        import torch
    except ImportError:
        sys.exit("this benchmark needs torch")
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    if "--driver" in sys.argv[1:]:
        for exportable in (False, True):
            print(json.dumps(by_driver(exportable)))
    else:
        print(json.dumps(through_gpumem()))


if __name__ == "__main__":
    main()
