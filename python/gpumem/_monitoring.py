"""GPUMEM_WARN_AT and GPUMEM_METRICS_PORT, started when gpumem is installed (gpumem._api).

GPUMEM_WARN_AT's watch is set at once (it starts no CUDA). GPUMEM_METRICS_PORT's endpoint opens
when torch first initializes CUDA (torch.cuda._lazy_call; at once if it already has): a process that
never uses CUDA has nothing to report and holds no port, so a launcher such as torchrun does not
take the port its rank 0 needs, nor do DataLoader workers that of their parent. LOCAL_RANK is read
then, so a worker started by torch.multiprocessing may still set it first.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from gpumem import metrics, pressure


def start(warn_at: Optional[float], metrics_port: Optional[int]) -> None:
    """Both settings as read (and checked) from the environment; None: not set."""
    if warn_at is not None:
        pressure.warn_at(warn_at)
    if metrics_port is not None:
        when_cuda_starts(lambda: metrics.serve_for_environment(metrics_port))


def when_cuda_starts(call: Callable[[], object]) -> None:
    """`call` once torch has initialized CUDA. It must not raise: torch would turn that into an error
    of the program's first CUDA call."""
    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if lazy_call is None:  # a torch without it: at once, which starts no CUDA either
        call()
        return
    lazy_call(call)
