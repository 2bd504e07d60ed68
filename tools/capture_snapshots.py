#!/usr/bin/env python3
"""Records real memory snapshots of two small training runs, for `gpumem replay` and its tests.

Run on a machine with a CUDA GPU, with PyTorch's NATIVE allocator (gpumem not installed, no
GPUMEM_LIMIT): the point is a trace of what PyTorch itself does.

    python3 tools/capture_snapshots.py [--out tests/python/data] [--steps 6]

Writes <out>/gpt_adamw.pickle (a GPT-style transformer of about 23M parameters, AdamW, a different
sequence length each step) and <out>/resnet_sgd.pickle (a small residual CNN, SGD with momentum).
Recording starts after the model is on the GPU and while a warm-up batch is still alive, so each
trace also holds blocks allocated before it began: the parameters (alive at dump time) and the
warm-up batch (freed during the trace). Stack traces are off (context=None) to keep each file small
(the script warns above 2 MB). Each snapshot is what torch.cuda.memory._snapshot() returns, plus
one key gpumem reads: "gpumem_device_totals", the devices' total memory in bytes. <out>/captured.json
records what PyTorch itself reported while recording (max_memory_allocated / max_memory_reserved),
which a replay with no limit should reproduce.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import pickle
import sys

import torch
import torch.nn.functional as F
from torch import nn

SIZE_WARNING = 2 << 20
DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "python" / "data"


class GPT(nn.Module):
    def __init__(self, vocab: int = 8192, width: int = 512, layers: int = 6, heads: int = 8, max_len: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(max_len, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        x = self.blocks(x, mask=causal, is_causal=True)
        return self.norm(x) @ self.embed.weight.T  # tied output head


def residual_block(channels_in: int, channels_out: int, stride: int) -> nn.Module:
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False), nn.BatchNorm2d(channels_out), nn.ReLU(),
                nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False), nn.BatchNorm2d(channels_out))
            self.skip = nn.Identity() if stride == 1 and channels_in == channels_out else nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out))

        def forward(self, x):
            return F.relu(self.body(x) + self.skip(x))

    return Block()


def resnet(classes: int = 10) -> nn.Module:
    widths = [32, 64, 128, 256]
    layers = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    for previous, width in zip([widths[0]] + widths, widths):
        layers += [residual_block(previous, width, 1 if previous == width else 2), residual_block(width, width, 1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes))


def train_gpt(steps: int, record) -> None:
    model = GPT().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    warm_up = torch.randint(0, 8192, (16, 512), device="cuda")
    with record():
        del warm_up
        for step in range(steps):
            length = (64, 256, 128, 512, 192, 384)[step % 6]
            tokens = torch.randint(0, 8192, (16, length + 1), device="cuda")
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del tokens, logits, loss


def train_resnet(steps: int, record) -> None:
    model = resnet().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    warm_up = torch.randn(32, 3, 64, 64, device="cuda")
    with record():
        del warm_up
        for step in range(steps):
            images = torch.randn(32 + 8 * (step % 3), 3, 64, 64, device="cuda")
            labels = torch.randint(0, 10, (images.shape[0],), device="cuda")
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del images, labels, loss


class Recording:
    """Records the allocator's history while the block runs; then holds the snapshot."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.snapshot: dict = {}
        self.peaks = (0, 0)

    def __call__(self) -> "Recording":
        return self

    def __enter__(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=self.max_entries, clear_history=True)

    def __exit__(self, *error) -> None:
        torch.cuda.synchronize()
        self.snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        self.snapshot["gpumem_device_totals"] = [
            torch.cuda.get_device_properties(d).total_memory for d in range(torch.cuda.device_count())]


def refuse_gpumem() -> None:
    if os.environ.get("GPUMEM_LIMIT"):
        sys.exit("capture_snapshots: unset GPUMEM_LIMIT: the traces must come from PyTorch's native allocator")
    if torch.cuda.memory.get_allocator_backend() != "native":
        sys.exit("capture_snapshots: PyTorch is not using its native allocator (PYTORCH_CUDA_ALLOC_CONF?)")
    gpumem = sys.modules.get("gpumem")
    if gpumem is not None and gpumem.is_enabled():
        sys.exit("capture_snapshots: gpumem is installed as the allocator in this process; run without it")


def summary(path: pathlib.Path) -> str:
    """Events and replayed peaks, when gpumem is importable here (it need not be)."""
    try:
        from gpumem.trace import replay
    except ImportError:
        return "gpumem not importable here: no replay check"
    result = replay.replay(str(path), "none")
    return (f"{result.events_total} events, {result.initial_blocks} blocks alive before the trace; replayed: "
            f"peak allocated {result.peak_allocated} (trace: {replay.peak_allocated_from_trace(str(path))}), "
            f"original peak reserved {result.original_peak_reserved}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-entries", type=int, default=20000, help="the trace's ring buffer (default 20000)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("capture_snapshots: needs a CUDA GPU")
    refuse_gpumem()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    captured = {}
    for name, train in (("gpt_adamw", train_gpt), ("resnet_sgd", train_resnet)):
        recording = Recording(args.max_entries)
        train(args.steps, recording)
        path = args.out / f"{name}.pickle"
        with open(path, "wb") as file:
            pickle.dump(recording.snapshot, file)
        size = path.stat().st_size
        print(f"{path}: {size} bytes; torch peaks while recording: allocated {recording.peaks[0]}, "
              f"reserved {recording.peaks[1]}")
        print(f"  {summary(path)}")
        if size > SIZE_WARNING:
            print(f"  warning: above {SIZE_WARNING >> 20} MB; use fewer --steps or a smaller --max-entries")
        captured[name] = {
            "torch_max_memory_allocated": recording.peaks[0], "torch_max_memory_reserved": recording.peaks[1],
            "torch_version": torch.__version__, "device": torch.cuda.get_device_name(0), "steps": args.steps}
        gc.collect()
        torch.cuda.empty_cache()
    (args.out / "captured.json").write_text(json.dumps(captured, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
