"""The one place monitoring starts: GPUMEM_WARN_AT, GPUMEM_METRICS_PORT and the figures for
`gpumem top` (GPUMEM_PUBLISH), started when gpumem is installed (gpumem.api). What each does is its
module's (pressure, metrics, publish); when, and what stops it without stopping the program, is here.

GPUMEM_WARN_AT's watch is set at once (it starts no CUDA). GPUMEM_METRICS_PORT's endpoint opens
when torch first initializes CUDA (torch.cuda._lazy_call; at once if it already has): a process that
never uses CUDA has nothing to report and holds no port, so a launcher such as torchrun does not
take the port its rank 0 needs, nor do DataLoader workers that of their parent. LOCAL_RANK is read
then, so a worker started by torch.multiprocessing may still set it first. Publishing starts then
too (gpumem.monitoring.publish), for the same reasons.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import Callable, Mapping, Optional

import torch

from gpumem.monitoring import metrics, pressure, publish
from gpumem.settings import metrics_endpoint
from gpumem.settings.echo import relayed, shown, shown_path
from gpumem.settings.run_dir import RunDir

RANK_VARIABLE = "LOCAL_RANK"


def start(warn_at: Optional[float], metrics_port: Optional[int], publish_dir: Optional[RunDir] = None,
          metrics_addr: str = metrics_endpoint.DEFAULT_ADDR) -> None:
    """The settings as read (and checked) from the environment; None: not set (for publish_dir:
    GPUMEM_PUBLISH=0)."""
    if warn_at is not None:
        pressure.warn_at(warn_at)
    at_cuda_start = []
    if metrics_port is not None:
        at_cuda_start.append(lambda: serve_metrics_for_environment(metrics_port, addr=metrics_addr))
    if publish_dir is not None:
        at_cuda_start.append(lambda: publish_for_environment(publish_dir))
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


def serve_metrics_for_environment(base: int, environ: Mapping[str, str] = os.environ,
                                  addr: str = metrics_endpoint.DEFAULT_ADDR) -> Optional[metrics.MetricsServer]:
    """GPUMEM_METRICS_PORT's endpoint: addr (GPUMEM_METRICS_ADDR's, else 127.0.0.1), port base +
    LOCAL_RANK. Never raises: what stops it is one line on stderr, and None."""
    try:
        port = base + _local_rank(environ)
        if port > 65535:
            raise ValueError(f"port {port} is above 65535")
        return metrics.serve_metrics(port, addr)
    except Exception as error:  # noqa: BLE001: the metrics must never stop the program
        reason = str(error).removeprefix("gpumem: ")
        sys.stderr.write(f"gpumem: GPUMEM_METRICS_PORT={base}: no metrics are served ({reason}); "
                         "the program goes on without them.\n")
        return None


def _local_rank(environ: Mapping[str, str]) -> int:
    text = environ.get(RANK_VARIABLE)
    if text is None:
        return 0
    if not (text.strip().isascii() and text.strip().isdigit() and len(text) <= 5):
        raise ValueError(f"{RANK_VARIABLE}={shown(text)} is not a number of 0 or more")
    return int(text)


_process_publisher: Optional[publish.Publisher] = None


def publish_for_environment(run_dir: RunDir) -> Optional[publish.Publisher]:
    """The process's publisher, started (once), at CUDA init. Never raises: what stops it is one
    line on stderr, and None."""
    global _process_publisher
    if _process_publisher is not None and _process_publisher.owner == os.getpid():
        return _process_publisher
    try:
        publish.prepare(run_dir)
        publisher = publish.Publisher(run_dir)
        publisher.start()
    except Exception as error:  # noqa: BLE001: publishing must never stop the program
        sys.stderr.write(f"gpumem: figures for `gpumem top` are not published in {shown_path(run_dir.path)} "
                         f"({relayed(error)}); the program goes on ({publish.TURN_OFF}).\n")
        return None
    atexit.register(publisher.stop)
    _process_publisher = publisher
    return publisher
