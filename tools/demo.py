"""gpumem's main job, shown: a hard cap on what a training run reserves.

With a GPU: trains a small transformer under a 2 GiB cap, grows the batch until the cap is hit,
catches torch.OutOfMemoryError, shrinks the batch and trains on; then prints gpumem.report().
Without one: replays a real training run, recorded on an H200 under PyTorch's own allocator
(tests/python/data/gpt_adamw.pickle: a small GPT with AdamW), through gpumem's allocator on a
simulated device under a 3 GB cap, prints the replay's report, and finds the smallest cap the run
fits under, with growable segments (gpumem's default) and with plain ones.
"""
import pathlib
import re
import sys

import torch

import gpumem
from gpumem import _C
from gpumem.trace import replay

LIMIT = "2GB"
REPLAY_LIMIT = "3GB"
SNAPSHOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "python" / "data" / "gpt_adamw.pickle"
GiB = 1 << 30


def row(step, batch, limit, note=""):
    allocated, reserved = torch.cuda.memory_allocated() / GiB, torch.cuda.memory_reserved() / GiB
    print(f"{step:>4}  {batch:>5}  {allocated:9.3f}  {reserved:9.3f}  {limit / GiB:6.2f}  {note}")


def train_on_gpu():
    gpumem.set_limit(LIMIT)
    print(f"gpumem demo on {torch.cuda.get_device_name()}, limit {LIMIT}")
    print("step  batch  alloc GiB  resvd GiB  limit")
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=6).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, limit, growing = 8, gpumem.get_limit(), True
    for step in range(16):
        try:
            model(torch.randn(batch, 256, 512, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            row(step, batch, limit)
            batch = batch * 2 if growing else batch
        except torch.OutOfMemoryError as e:
            opt.zero_grad(set_to_none=True)
            found = re.search(r"gpumem: (over the limit|device full|fragmentation)", str(e))
            case = found.group(1) if found else "out of memory"
            row(step, batch, limit, f"OOM ({case}): back to batch {batch // 2}, training on")
            batch, growing = batch // 2, False
    print(gpumem.report())


def replay_on_simulated_device():
    size = _C.format_bytes
    print(f"gpumem demo without a GPU: replaying {SNAPSHOT.name}, recorded on an H200 under PyTorch's allocator")
    result = replay.replay(SNAPSHOT, REPLAY_LIMIT)
    verdict = "fits" if result.fits else f"does not fit: {result.failure.message}"
    print(f"under a {REPLAY_LIMIT} cap the run {verdict} ({result.allocs_replayed} allocs, "
          f"{result.frees_replayed} frees); peak reserved {size(result.peak_reserved)} under gpumem, "
          f"{size(result.original_peak_reserved)} in the recorded run\n")
    print(result.report())
    found = replay.min_limit(SNAPSHOT)
    plain = replay.min_limit(SNAPSHOT, segments="plain")
    print(f"\nthe smallest cap it fits under: {size(found.limit)}, {found.ratio:.3f} x its peak requested "
          f"({size(found.peak_allocated)}); {size(found.precision)} less fails")
    print(f"with plain segments (gpumem.set_segments(\"plain\")) instead of growable ones: {size(plain.limit)}, "
          f"{plain.ratio:.3f} x")


if __name__ == "__main__":
    if torch.cuda.is_available():
        train_on_gpu()
    else:
        replay_on_simulated_device()
    sys.exit(0)
