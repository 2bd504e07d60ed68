"""gpumem's main job, shown: a training loop under a byte cap, with what it reserved.

With a GPU: trains a small transformer under a 2 GiB cap, grows the batch until the cap is hit,
catches torch.OutOfMemoryError, halves the batch and trains on. Without one: the same growth runs
on gpumem's simulated device (no memory is touched), so the cap's behaviour can be seen anywhere.
"""
import sys

import torch

import gpumem
from gpumem import _C

LIMIT = "2GB"
GiB = 1 << 30


def row(step, batch, allocated, reserved, limit, note=""):
    print(f"{step:>4}  {batch:>5}  {allocated / GiB:9.3f}  {reserved / GiB:9.3f}  {limit / GiB:6.2f}  {note}")


def header(where):
    print(f"gpumem demo on {where}, limit {LIMIT}")
    print("step  batch  alloc GiB  resvd GiB  limit")


def train_on_gpu():
    gpumem.set_limit(LIMIT)
    header(torch.cuda.get_device_name())
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=6).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, limit = 8, gpumem.get_limit()
    for step in range(24):
        try:
            x = torch.randn(batch, 256, 512, device="cuda")
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            row(step, batch, torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), limit)
            batch *= 2
        except torch.OutOfMemoryError as e:
            opt.zero_grad(set_to_none=True)
            case = str(e).split("(gpumem: ")[1].split(")")[0]
            row(step, batch, torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), limit, f"OOM ({case}): batch / 4")
            batch = max(1, batch // 4)
    print(f"peak reserved {torch.cuda.max_memory_reserved() / GiB:.3f} GiB <= limit {limit / GiB:.2f} GiB")
    print(torch.cuda.memory_summary(abbreviated=True))


def simulate():
    sim = _C.SimAllocator(16 * GiB)
    sim.set_limit(0, LIMIT)
    limit = sim.get_limit(0)
    header("the simulated device (no GPU found)")
    weights = [sim.malloc(0, 24 << 20) for _ in range(40)]  # ~1 GiB of parameters and optimizer state
    batch = 8
    for step in range(16):
        acts = []
        try:
            for _ in range(12):  # one step's activations
                acts.append(sim.malloc(0, batch * (1 << 20)))
            row(step, batch, sim.stats(0)["allocated_bytes.all.current"], sim.reserved(0), limit)
            batch *= 2
        except _C.OutOfMemoryError as e:
            case = str(e).split("(gpumem: ")[1].split(")")[0]
            row(step, batch, sim.stats(0)["allocated_bytes.all.current"], sim.reserved(0), limit, f"OOM ({case}): batch / 4")
            batch = max(1, batch // 4)
        finally:
            for a in acts:
                sim.free(a)
    ledger = sim.ledger(0)
    print(f"peak reserved on the device {ledger['peak'] / GiB:.3f} GiB <= limit {limit / GiB:.2f} GiB")
    for w in weights:
        sim.free(w)


if __name__ == "__main__":
    if torch.cuda.is_available():
        train_on_gpu()
    else:
        simulate()
    sys.exit(0)
