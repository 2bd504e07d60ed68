#!/usr/bin/env python3
"""What pausing and resuming a region costs on this GPU, against the copy bandwidth it could reach.

    python3 benchmarks/bench_pause.py [GIB]     # default: 40 GiB (half the device below 64 GiB)

One process, gpumem enabled. A region with a backup holds GIB of live tensors (weights, an
optimizer-like state, a KV-cache-like buffer, in 8:4:4 parts) and a CUDA graph captured over them;
the process is paused (gpumem.pause(): every region and the other cache) and resumed three times.
Printed, one JSON line each:
  - pinned: torch's copies of one pinned host tensor of 4 GiB to and from the device, GiB/s, and
    the rate at which new host memory was pinned for it (pin_new);
  - backup: each cycle's pause and resume, seconds and GiB/s over the backed-up bytes, and the
    share of the pinned bandwidth that is; the device's used memory (NVML for this process where
    the driver lists it, else the device's) before and after the pause, and the share of reserved
    memory less the CUDA context that went back; whether every tensor's contents and the graph's
    replay came back the same;
  - prepared: the backup dropped, its host memory pinned again by prepare_backups (seconds and
    GiB/s), then one more cycle as above: a first pause whose host memory was pinned ahead;
  - no_backup: the same region made without a backup, pause and resume in ms per 10 GiB.
Needs a CUDA GPU with virtual memory management.
"""
import json
import os
import sys
import time

GiB = 1 << 30


def nvml_used() -> tuple[str, int]:
    """This process's used memory on device 0 by NVML where listed, else the device's used memory."""
    import torch
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                return "nvml process", int(p.usedGpuMemory)
    except Exception:  # noqa: BLE001 - no NVML, or a container's pids: fall back to the device
        pass
    free, total = torch.cuda.mem_get_info()
    return "device", total - free


def pinned_bandwidth(torch) -> dict:
    start = time.perf_counter()
    host = torch.empty(4 * GiB, dtype=torch.uint8, pin_memory=True)  # what pinning new host memory costs
    pin_s = time.perf_counter() - start
    dev = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    out = {"pin_new": round(4 / pin_s, 2)}
    for name, copy in (("to_host", lambda: host.copy_(dev, non_blocking=True)),
                       ("to_device", lambda: dev.copy_(host, non_blocking=True))):
        copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            copy()
        torch.cuda.synchronize()
        out[name] = round(3 * 4 / (time.perf_counter() - start), 2)
    del host, dev
    torch.cuda.empty_cache()
    return out


def digest(torch, tensors) -> list[int]:
    """Sums of each tensor's bits in 256 MiB pieces: a copy of every tensor would need its size again."""
    return [int(piece.sum(dtype=torch.int64)) for t in tensors for piece in t.view(-1).view(torch.int32).split(64 << 20)]


def build(torch, gpumem, tag: str, gib: float, backup: bool):
    parts = [int(gib * share * GiB) // 4 for share in (0.5, 0.25, 0.25)]
    with gpumem.region(tag, backup=backup):
        tensors = [torch.randn(n, device="cuda") for n in parts]
    return tensors


def main() -> None:
    import torch
    import gpumem
    gpumem.enable()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    total = torch.cuda.get_device_properties(0).total_memory
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else (40.0 if total >= 64 * GiB else total / GiB / 2)
    torch.empty(1, device="cuda")
    context_source, context = nvml_used()  # the CUDA context and torch's own buffers, before any tensor
    pinned = pinned_bandwidth(torch)
    print(json.dumps({"pinned_gib_per_s": pinned, "device": torch.cuda.get_device_name()}), flush=True)

    tensors = build(torch, gpumem, "engine", gib, backup=True)
    keep = [t[-(1 << 20):].cpu() for t in tensors]  # the last MiB of each (a whole copy would need host memory twice)
    sums = digest(torch, tensors)
    static = torch.ones(4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            out = sum((t[:4096] * static).sum() for t in tensors)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    expected = out.item()
    backed = sum(t.numel() * t.element_size() for t in tensors)

    def cycle(case: str, number: int, extra: dict) -> None:
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        source, used_before = nvml_used()
        start = time.perf_counter()
        paused = gpumem.pause()  # everything: the region, and the other pools' cache (the checks' own)
        pause_s = time.perf_counter() - start
        _, used_paused = nvml_used()
        start = time.perf_counter()
        gpumem.resume()
        resume_s = time.perf_counter() - start
        graph.replay()
        same = (all(torch.equal(t[-(1 << 20):].cpu(), k) for t, k in zip(tensors, keep))
                and digest(torch, tensors) == sums and out.item() == expected)
        print(json.dumps({
            "case": case, "cycle": number, **extra, "gib": round(backed / GiB, 2), "paused_gib": round(paused / GiB, 2),
            "pause_s": round(pause_s, 3), "resume_s": round(resume_s, 3),
            "pause_gib_per_s": round(backed / GiB / pause_s, 2), "resume_gib_per_s": round(backed / GiB / resume_s, 2),
            "pause_share_of_pinned": round(backed / GiB / pause_s / pinned["to_host"], 3),
            "resume_share_of_pinned": round(backed / GiB / resume_s / pinned["to_device"], 3),
            "used_source": source, "used_before_gib": round(used_before / GiB, 2), "used_paused_gib": round(used_paused / GiB, 2),
            "context_gib": round(context / GiB, 2) if context_source == source else None,
            "dropped_share_of_reserved": round((used_before - used_paused) / reserved, 4),
            "same": same,
        }), flush=True)

    for number in range(3):
        cycle("backup", number, {})
    # The first pause again, its host memory pinned ahead by prepare_backups.
    gpumem.drop_backups("engine")
    start = time.perf_counter()
    prepared = gpumem.prepare_backups("engine")
    prepare_s = time.perf_counter() - start
    cycle("prepared", 0, {"prepared_gib": round(prepared / GiB, 2), "prepare_s": round(prepare_s, 3),
                          "prepare_gib_per_s": round(prepared / GiB / prepare_s, 2)})
    del tensors, keep, out, graph
    torch.cuda.empty_cache()

    tensors = build(torch, gpumem, "cache", gib, backup=False)
    size = sum(t.numel() * t.element_size() for t in tensors)
    for number in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        paused = gpumem.pause("cache")
        pause_s = time.perf_counter() - start
        start = time.perf_counter()
        gpumem.resume("cache")
        resume_s = time.perf_counter() - start
        per10 = 10 * GiB / paused
        print(json.dumps({"case": "no_backup", "cycle": number, "gib": round(size / GiB, 2),
                          "pause_ms_per_10gib": round(pause_s * 1e3 * per10, 1),
                          "resume_ms_per_10gib": round(resume_s * 1e3 * per10, 1)}), flush=True)


if __name__ == "__main__":
    main()
