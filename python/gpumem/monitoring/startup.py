"""GPUMEM_WARN_AT, GPUMEM_METRICS_PORT and the figures for `gpumem top` (GPUMEM_PUBLISH), started
when gpumem is installed (gpumem.api).

GPUMEM_WARN_AT's watch is set at once (it starts no CUDA). GPUMEM_METRICS_PORT's endpoint opens
when torch first initializes CUDA (torch.cuda._lazy_call; at once if it already has): a process that
never uses CUDA has nothing to report and holds no port, so a launcher such as torchrun does not
take the port its rank 0 needs, nor do DataLoader workers that of their parent. LOCAL_RANK is read
then, so a worker started by torch.multiprocessing may still set it first. Publishing starts then
too (gpumem.monitoring.publish), for the same reasons.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from gpumem.monitoring import metrics, pressure, publish
from gpumem.settings import metrics_endpoint
from gpumem.settings.run_dir import RunDir


def start(warn_at: Optional[float], metrics_port: Optional[int], publish_dir: Optional[RunDir] = None,
          metrics_addr: str = metrics_endpoint.DEFAULT_ADDR) -> None:
    """The settings as read (and checked) from the environment; None: not set (for publish_dir:
    GPUMEM_PUBLISH=0)."""
    if warn_at is not None:
        pressure.warn_at(warn_at)
    at_cuda_start = []
    if metrics_port is not None:
        at_cuda_start.append(lambda: metrics.serve_for_environment(metrics_port, addr=metrics_addr))
    if publish_dir is not None:
        at_cuda_start.append(lambda: publish.start_for_environment(publish_dir))
    if at_cuda_start:
        when_cuda_starts(lambda: [call() for call in at_cuda_start])


def when_cuda_starts(call: Callable[[], object]) -> None:
    """`call` once torch has initialized CUDA. It must not raise: torch would turn that into an error
    of the program's first CUDA call."""
    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if lazy_call is None:  # a torch without it: at once, which starts no CUDA either
        call()
        return
    lazy_call(call)
