"""A stand-in for gpumem._C on a machine with no GPU.

The limit grammar is the real one; each fake device is a real SimAllocator of its own size, so
limits and segment kinds set through the Python API land in an allocator that enforces them.
Each device maps 2 MiB pages (growable segments in use, as on a GPU with CUDA virtual memory
management) unless its page size is given as 0.
"""
from __future__ import annotations

import sys

import torch

from gpumem import _C

GiB = 1 << 30
PAGE = 2 << 20


class FakeC:
    limit_forms = _C.limit_forms
    parse_limit = staticmethod(_C.parse_limit)
    parse_limit_assignments = staticmethod(_C.parse_limit_assignments)
    resolve_limit_text = staticmethod(_C.resolve_limit_text)  # what _run_setup applies, so one verdict
    format_bytes = staticmethod(_C.format_bytes)
    OutOfMemoryError = _C.OutOfMemoryError
    LimitSpecError = _C.LimitSpecError

    def __init__(self, totals: list[int], page_sizes: list[int] | None = None):
        self.totals = list(totals)
        self.page_sizes = list(page_sizes) if page_sizes is not None else [PAGE] * len(totals)
        self.sims = [_C.SimAllocator(total, page_size=page) for total, page in zip(totals, self.page_sizes)]
        self.installed = False
        self.install_calls = 0
        self.install_args: list[tuple] = []
        self.device_count_calls = 0
        self.settings_changes: list[tuple] = []
        self._pending = None  # (GPUMEM_LIMIT text, growable, scope, chunk) until a device is first used
        self.install_scope = None
        self.release_thresholds = [0.0] * len(totals)
        self.peak_resets: list[int] = []
        self.joined: list[tuple[int, str]] = []  # (device, table path) of the tables joined, in order
        self.floors: dict[int, int] = {}
        self.join_errors: dict[int, Exception] = {}  # what joining a device's table raises

    # ---- what the tests look at ---------------------------------------------------------------

    def limits(self) -> list[int]:
        return [self.get_limit(device) for device in range(len(self.totals))]

    def segments(self) -> list[bool]:
        """Whether growable segments are in effect, per device."""
        return [self.get_growable(device) for device in range(len(self.totals))]

    def malloc(self, device: int, size: int) -> int:
        return self._sim(device).malloc(0, size)

    # ---- the _C interface -----------------------------------------------------------------------

    def install(self, limits=None, growable=None, scope=None, chunk=None) -> None:
        # As the compiled layer: settings are kept, and applied when a device is first used.
        if not self.installed:
            self._pending = (limits, growable, scope, chunk)
            self.install_args.append((limits, growable))
            self.install_scope = scope
        self.installed = True
        self.install_calls += 1

    def is_installed(self) -> bool:
        return self.installed

    def device_count(self) -> int:
        self.device_count_calls += 1
        return len(self.totals)

    def device_total(self, device: int) -> int:
        if not 0 <= device < len(self.totals):
            raise ValueError(f"fake _C: device {device} is not in 0..{len(self.sims) - 1}")
        return self.totals[device]

    def mem_info(self, device: int) -> tuple[int, int]:
        sim = self._sim(device)
        return self.totals[device] - sim.reserved(0), self.totals[device]

    def capped_mem_info(self, device: int, free: int, total: int) -> tuple[int, int]:
        limit, reserved = self.get_limit(device), self._sim(device).reserved(0)
        return min(free, max(limit - reserved, 0)), min(limit, total)

    def apply_changed_torch_settings(self, text: str, keep_segments: bool, keep_threshold: bool) -> None:
        self.settings_changes.append((text, keep_segments, keep_threshold))

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

    def set_growable(self, device: int, on: bool) -> None:
        self._sim(device).set_growable(0, on)

    def set_scope(self, device: int, scope: str) -> None:
        self._sim(device).set_scope(0, scope)

    def get_scope(self, device: int) -> str:
        return self._sim(device).get_scope(0)

    def outside(self, device: int) -> int:
        return self._sim(device).outside(0)

    def paused_bytes(self, device: int) -> tuple[int, int]:
        figures = self._sim(device).device_figures(0, False)
        return figures["paused"], figures["paused_allocated"]

    def outside_source(self, device: int) -> str:
        return self._sim(device).outside_source(0)

    def get_growable(self, device: int) -> bool:
        return self._sim(device).growable(0)

    def set_large_chunk(self, device: int, nbytes: int) -> None:
        self._sim(device).set_large_chunk(0, nbytes)

    def get_large_chunk(self, device: int) -> int:
        return self._sim(device).large_chunk(0)

    def growable_supported(self, device: int) -> bool:
        self._sim(device)
        return self.page_sizes[device] > 0

    def page_size(self, device: int) -> int:
        self._sim(device)
        return self.page_sizes[device]

    def empty_cache(self) -> None:
        for sim in self.sims:
            sim.empty_cache(0)

    def stats(self, device: int) -> dict:
        return self._sim(device).stats(0)

    def reset_peak_stats(self, device: int) -> None:
        self._sim(device)
        self.peak_resets.append(device)

    # What monitoring reads (gpumem.metrics, gpumem.pressure): each fake device is device 0 of its sim.
    def existing_devices(self) -> list[int]:
        return [device for device, sim in enumerate(self.sims) if sim.existing_devices()]

    def device_figures(self, device: int, device_memory: bool = True) -> dict:
        return self.sims[device].device_figures(0, device_memory)

    def watch_pressure(self, share: float) -> None:
        for sim in self.sims:
            sim.watch_pressure(share)

    def pressure_crossings(self) -> list[tuple]:
        return [(device, *rest) for device, sim in enumerate(self.sims) for _, *rest in sim.pressure_crossings()]

    # Sharing (gpumem.sharing): what was joined and set; no table.
    def share_join(self, device: int, path: str) -> None:
        self._sim(device)
        if device in self.join_errors:
            raise self.join_errors[device]
        if all(joined != device for joined, _ in self.joined):
            self.joined.append((device, path))

    def share_leave_all(self) -> None:
        self.joined.clear()
        self.floors.clear()

    def share_set_floor(self, device: int, nbytes: int) -> int:
        grant = self.share_grant_floor(device, nbytes)
        return grant["asked"] - grant["granted"] + grant["short"]

    def share_grant_floor(self, device: int, nbytes: int) -> dict:
        if all(joined != device for joined, _ in self.joined):
            raise ValueError(f"fake _C: device {device} does not share its GPU: join first")
        self.floors[device] = nbytes
        return {"asked": nbytes, "granted": nbytes, "short": 0, "floor_holders": []}

    def _sim(self, device: int):
        if not 0 <= device < len(self.sims):
            raise ValueError(f"fake _C: device {device} is not in 0..{len(self.sims) - 1}")
        self._run_setup()
        return self.sims[device]

    def _run_setup(self) -> None:
        """The deferred setup, with the compiled layer's own resolution of GPUMEM_LIMIT; if it
        raises, nothing changed and it runs again at the next use."""
        if self._pending is None:
            return
        text, growable, scope, chunk = self._pending
        limits = self.resolve_limit_text(text, self.totals) if text is not None else [None] * len(self.sims)
        self._pending = None
        for sim, nbytes in zip(self.sims, limits):
            if nbytes is not None:
                sim.set_limit_bytes(0, nbytes)
            if growable is not None:
                sim.set_growable(0, growable)
            if scope is not None:
                sim.set_scope(0, scope)
            if chunk is not None:
                sim.set_large_chunk(0, chunk)


def use_fake_c(monkeypatch, fake: FakeC) -> None:
    """Points gpumem at `fake`, with CUDA not yet initialized and GPUMEM_LIMIT and GPUMEM_SEGMENTS unset."""
    # Every gpumem module that holds the compiled module by name gets the fake instead.
    for name, module in list(sys.modules.items()):
        if (name == "gpumem" or name.startswith("gpumem.")) and getattr(module, "_C", None) is _C:
            monkeypatch.setattr(module, "_C", fake)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("GPUMEM_LIMIT", raising=False)
    monkeypatch.delenv("GPUMEM_SEGMENTS", raising=False)
    monkeypatch.delenv("GPUMEM_SCOPE", raising=False)
    monkeypatch.delenv("GPUMEM_CHUNK", raising=False)
    monkeypatch.delenv("GPUMEM_MEM_INFO", raising=False)
    # What installing wraps in torch is put back after the test, and wrapped afresh in the next.
    from gpumem import _torch_hooks

    monkeypatch.setattr(torch.cuda.memory, "mem_get_info", torch.cuda.memory.mem_get_info)
    monkeypatch.setattr(torch.cuda, "mem_get_info", torch.cuda.mem_get_info)
    for setter_name in _torch_hooks.SETTINGS_SETTERS:
        setter = getattr(torch._C, setter_name, None)
        if setter is not None:
            monkeypatch.setattr(torch._C, setter_name, setter)
    for name, value in [("_original_mem_get_info", None), ("_original_set_settings", {}), ("_view", "capped"),
                        ("fixed", {"segments": False, "release_threshold": False})]:
        monkeypatch.setattr(_torch_hooks, name, value)
