"""A stand-in for gpumem._C on a machine with no GPU.

The limit grammar is the real one; each fake device is a real SimAllocator of its own size, so
limits set through the Python API land in an allocator that enforces them.
"""
from __future__ import annotations

import sys

import torch

from gpumem import _C

GiB = 1 << 30


class FakeC:
    limit_forms = _C.limit_forms
    parse_limit = staticmethod(_C.parse_limit)
    parse_limit_assignments = staticmethod(_C.parse_limit_assignments)
    format_bytes = staticmethod(_C.format_bytes)
    OutOfMemoryError = _C.OutOfMemoryError

    def __init__(self, totals: list[int]):
        self.totals = list(totals)
        self.sims = [_C.SimAllocator(total) for total in totals]
        self.installed = False
        self.install_calls = 0
        self.release_thresholds = [0.0] * len(totals)
        self.peak_resets: list[int] = []

    # ---- what the tests look at ---------------------------------------------------------------

    def limits(self) -> list[int]:
        return [self.get_limit(device) for device in range(len(self.totals))]

    def malloc(self, device: int, size: int) -> int:
        return self._sim(device).malloc(0, size)

    # ---- the _C interface -----------------------------------------------------------------------

    def install(self) -> None:
        self.installed = True
        self.install_calls += 1

    def is_installed(self) -> bool:
        return self.installed

    def device_count(self) -> int:
        return len(self.totals)

    def mem_info(self, device: int) -> tuple[int, int]:
        sim = self._sim(device)
        return self.totals[device] - sim.reserved(0), self.totals[device]

    def set_limit(self, device: int, spec: str) -> None:
        self._sim(device).set_limit(0, spec)

    def set_limit_bytes(self, device: int, nbytes) -> None:
        self._sim(device).set_limit_bytes(0, nbytes)

    def get_limit(self, device: int) -> int:
        return self._sim(device).get_limit(0)

    def set_release_threshold(self, device: int, share: float) -> None:
        self._sim(device)
        self.release_thresholds[device] = share

    def get_release_threshold(self, device: int) -> float:
        self._sim(device)
        return self.release_thresholds[device]

    def empty_cache(self) -> None:
        for sim in self.sims:
            sim.empty_cache(0)

    def stats(self, device: int) -> dict:
        return self._sim(device).stats(0)

    def reset_peak_stats(self, device: int) -> None:
        self._sim(device)
        self.peak_resets.append(device)

    def _sim(self, device: int):
        if not 0 <= device < len(self.sims):
            raise ValueError(f"fake _C: device {device} is not in 0..{len(self.sims) - 1}")
        return self.sims[device]


def use_fake_c(monkeypatch, fake: FakeC) -> None:
    """Points gpumem at `fake`, with CUDA not yet initialized and GPUMEM_LIMIT unset."""
    # Every gpumem module that holds the compiled module by name gets the fake instead.
    for name, module in list(sys.modules.items()):
        if (name == "gpumem" or name.startswith("gpumem.")) and getattr(module, "_C", None) is _C:
            monkeypatch.setattr(module, "_C", fake)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("GPUMEM_LIMIT", raising=False)
