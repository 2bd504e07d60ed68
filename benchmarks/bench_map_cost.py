#!/usr/bin/env python3
"""What growing and shrinking a growable segment costs on this GPU: one 1 GiB and one 4 GiB tensor
made on an empty cache (every 2 MiB page mapped then) and given back with empty_cache (every page
unmapped), in microseconds per page. Needs a CUDA GPU with virtual memory management.

    python3 benchmarks/bench_map_cost.py
"""
import json
import sys
import time

import gpumem
import torch

PAGE = 2 << 20


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
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
    print(json.dumps(result))


if __name__ == "__main__":
    main()
