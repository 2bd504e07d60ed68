"""The benchmarks' training workload: a GPT-2-small-shaped decoder (about 124M parameters) and
one training step of it (bf16 autocast, AdamW), with random tokens made on the GPU.

The model's shape follows GPT-2 small: 12 layers, width 768, 12 heads, context 1024, the
vocabulary padded to 50304, output head tied to the token embedding. Attention is torch's
scaled_dot_product_attention (flash attention on an H200), so activation memory grows linearly
with the sequence length and the logits (batch x length x 50304) are the largest tensors.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 50304
MAX_LEN = 1024


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = 768, layers: int = 12, heads: int = 12,
                 max_len: int = MAX_LEN):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T  # tied output head


def build(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    """The model on the GPU and its AdamW optimizer (its state appears at the first step)."""
    torch.manual_seed(seed)
    model = GPT().cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train_step(model: GPT, optimizer: torch.optim.Optimizer, batch: int, length: int, device: str = "cuda") -> None:
    """One step on random tokens; queues GPU work and returns without synchronizing."""
    vocab = model.embed.num_embeddings
    tokens = torch.randint(0, vocab, (batch, length + 1), device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def varying_lengths(seed: int = 0, step: int = 64) -> list[int]:
    """Every multiple of `step` up to MAX_LEN once, in a seeded random order: one pass of steps."""
    lengths = list(range(step, MAX_LEN + 1, step))
    random.Random(seed).shuffle(lengths)
    return lengths
