#!/usr/bin/env python3
"""Training a GPT-style model (benchmarks/models.py, about 124M parameters, bf16 autocast, AdamW)
under one allocator per process.

--mode step: batch --batch (16); a pass is 16 steps whose sequence lengths are 64, 128, ...,
  1024 in a seeded random order, the same in every process. One warm-up pass, then --passes
  timed passes; step time = median pass time / 16. Also the peaks over the whole run:
  max_memory_reserved / max_memory_allocated.
--mode cap: under --cap (4GiB), batches 1, 2, 3, ... at sequence length 1024, --cap-steps steps
  each, the cache emptied between batches (the model and optimizer state stay, as in a job);
  stops at the first out-of-memory error. Reports the largest batch that trained and, for the
  first that failed, what the error message says: the request, the bytes allocated and reserved
  but unallocated, and whether allocated + request exceeded the cap (it does not fit) or not
  (reserved memory the allocator could not use made it fail). gpumem, gpumem-plain: gpumem.set_limit(cap);
  native: torch.cuda.set_per_process_memory_fraction(cap / total), as the only cap it has.
--mode reference: the cap search with no cap (run it with --allocator native): each batch's peak
  allocated bytes, stopping at the first batch whose peak passes --cap. The largest batch whose
  allocated memory fits under the cap is what --mode cap should reach.

    python3 benchmarks/bench_training.py --mode step --allocator gpumem [--out FILE]
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import time
from typing import Optional

from common import ALLOCATORS, apply_cap, check_allocator, log, median, select_allocator, write_json

CAP_LENGTH = 1024
_SIZE = r"([\d.]+) (bytes?|KiB|MiB|GiB|TiB)"
_UNITS = {"byte": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# The messages print sizes with two decimals: a GiB figure is known to about 5 MiB.
_ROUNDING = 16 << 20


def step_mode(args) -> dict:
    import torch
    import models

    model, optimizer = models.build()
    lengths = models.varying_lengths()

    def one_pass() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for length in lengths:
            models.train_step(model, optimizer, args.batch, length)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    one_pass()  # warm-up: optimizer state, kernels' plans, the allocator's cache
    passes = []
    for n in range(args.passes):
        passes.append(one_pass())
        log(f"{args.allocator}: pass {n + 1}/{args.passes}: {passes[-1] * 1e3 / len(lengths):.2f} ms/step")
    peak_allocated, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {
        "batch": args.batch, "lengths": lengths, "parameters": models.parameter_count(model),
        "step_ms": median(passes) * 1e3 / len(lengths), "pass_s": passes,
        "peak_allocated": peak_allocated, "peak_reserved": peak_reserved,
        "reserved_over_allocated": peak_reserved / peak_allocated,
    }


def batch_search(args, limit: Optional[int]) -> dict:
    """Batches 1, 2, ... at CAP_LENGTH until one fails (or, with no limit, passes args.cap)."""
    import torch
    import models

    model, optimizer = models.build()
    trials, failure = [], None
    for batch in range(1, args.max_batch + 1):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            for _ in range(args.cap_steps):
                models.train_step(model, optimizer, batch, CAP_LENGTH)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as error:
            failure = {"batch": batch, **oom_facts(str(error), limit)}
            log(f"{args.allocator}: batch {batch}: out of memory ({failure['verdict']})")
            break
        trial = {"batch": batch, "seconds": time.perf_counter() - start,
                 "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}
        trials.append(trial)
        log(f"{args.allocator}: batch {batch}: trained; peak allocated {trial['peak_allocated'] / 2**30:.2f} GiB, "
            f"reserved {trial['peak_reserved'] / 2**30:.2f} GiB")
        if limit is None and trial["peak_allocated"] > args.cap_bytes:
            break
        if limit is not None and trial["peak_reserved"] > limit:
            log(f"{args.allocator}: the cap did not hold: reserved passed {limit} bytes; stopping")
            break
    if limit is None:  # the reference: batches whose peak allocated fits under the cap
        fitting = [t["batch"] for t in trials if t["peak_allocated"] <= args.cap_bytes]
    else:  # batches that trained with the cap holding
        fitting = [t["batch"] for t in trials if t["peak_reserved"] <= limit]
    return {"length": CAP_LENGTH, "steps": args.cap_steps, "trials": trials, "failure": failure,
            "cap_held": limit is None or all(t["peak_reserved"] <= limit for t in trials),
            "largest_batch": max(fitting, default=0)}


def oom_facts(message: str, limit: Optional[int]) -> dict:
    """What an out-of-memory message says, and whether allocated + request passed the limit."""
    facts: dict = {"message": message[:800]}
    request = re.search(r"Tried to allocate " + _SIZE, message)
    held = re.search(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch,.*?and " + _SIZE
                     + r" is reserved by PyTorch but unallocated", message, re.S)
    kind = re.search(r"gpumem: (over the limit|device full|fragmentation)", message)
    if kind:
        facts["gpumem_kind"] = kind.group(1)
    if not (request and held and limit is not None):
        facts["verdict"] = "unknown (message not understood)"
        return facts
    facts["request"] = _bytes(*request.groups())
    facts["allocated"] = _bytes(*held.groups()[:2])
    facts["reserved_unallocated"] = _bytes(*held.groups()[2:])
    over = facts["allocated"] + facts["request"] - limit
    facts["allocated_plus_request_minus_limit"] = over
    if abs(over) <= _ROUNDING:
        facts["verdict"] = "within the message's rounding of the limit"
    else:
        facts["verdict"] = "does not fit" if over > 0 else "fragmentation: allocated + request fit under the limit"
    return facts


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("step", "cap", "reference"), required=True)
    parser.add_argument("--allocator", choices=ALLOCATORS, required=True)
    parser.add_argument("--batch", type=int, default=16, help="step mode's batch (default 16)")
    parser.add_argument("--passes", type=int, default=4, help="step mode's timed passes of 16 steps (default 4)")
    parser.add_argument("--cap", default="4GiB", help="cap and reference modes' cap (default 4GiB)")
    parser.add_argument("--cap-steps", type=int, default=3, help="steps per batch size (default 3)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--out", default="", help="write the JSON result here too")
    args = parser.parse_args()
    if args.mode == "reference" and args.allocator != "native":
        parser.error("--mode reference measures PyTorch's own peaks: use --allocator native")
    select_allocator(args.allocator)
    check_allocator(args.allocator)
    import torch
    from gpumem import _C

    args.cap_bytes = _C.parse_limit(args.cap, 1 << 62)
    record = {"mode": args.mode, "allocator": args.allocator, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if args.mode == "step":
        record.update(step_mode(args))
    elif args.mode == "cap":
        limit = apply_cap(args.allocator, args.cap_bytes)
        record.update(cap=args.cap_bytes, limit=limit, **batch_search(args, limit))
    else:
        record.update(cap=args.cap_bytes, **batch_search(args, None))
    write_json(args.out, record)


if __name__ == "__main__":
    main()
