"""gpumem: a byte-level hard cap on PyTorch's CUDA memory.

    import gpumem
    gpumem.set_limit("4GB")   # before the first CUDA allocation
"""
from gpumem import _invocation  # the standard library only, and nothing that needs torch

with _invocation.interrupt_exits_quietly():  # Ctrl-C while `python -m gpumem` starts: exit 130
    # torch before _C: loading the compiled module before torch has set itself up crashes the process.
    import torch  # noqa: F401

    from gpumem import _build_check

    _build_check.require_matching_torch()  # before _C, which under another torch fails to load or worse

    try:
        from gpumem import _C
    except ImportError as error:
        raise ImportError(
            "gpumem: its compiled module gpumem._C could not be imported "
            f"({error}). Build it from the gpumem source tree, with PyTorch already installed: "
            "`pip install --no-build-isolation .`"
        ) from error

    from gpumem._api import (
        device_mem_info,
        empty_cache,
        enable,
        get_limit,
        get_scope,
        get_segments,
        is_enabled,
        reset_peak_stats,
        set_limit,
        set_release_threshold,
        set_mem_info_view,
        set_segments,
        stats,
    )
    from gpumem import timeline
    from gpumem.metrics import serve_metrics
    from gpumem.pressure import on_pressure
    from gpumem.reporting import Report, collect as report

__all__ = [
    "Report",
    "device_mem_info",
    "empty_cache",
    "enable",
    "get_limit",
    "get_scope",
    "get_segments",
    "is_enabled",
    "on_pressure",
    "report",
    "reset_peak_stats",
    "serve_metrics",
    "set_limit",
    "set_mem_info_view",
    "set_release_threshold",
    "set_segments",
    "stats",
    "timeline",
]
