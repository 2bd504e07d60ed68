"""gpumem: a byte-level hard cap on PyTorch's CUDA memory.

    import gpumem
    gpumem.set_limit("4GB")   # before the first CUDA allocation

The package, each layer importing only those below it (tests/python/test_package_layers.py):

    gpumem.api         the public functions, exported here (set_limit, enable, stats, ...)
    gpumem.regions     regions of memory paused and resumed (region, pause, resume, paused,
                       prepare_backups, drop_backups)
    gpumem.cli         the `gpumem` command and `python -m gpumem`
    gpumem.sharing     sharing a GPU with other gpumem processes
    gpumem.monitoring  what a process shows of itself: metrics, pressure alerts, the timeline and
                       report, the figures published for `gpumem top`, and top
    gpumem.trace       memory snapshots read safely and replayed under a limit
    gpumem.settings    what users give gpumem (variables, arguments, files), read and checked
    gpumem._C          the compiled allocator
"""
import sys

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

    from gpumem.api import (
        device_mem_info,
        empty_cache,
        enable,
        get_limit,
        get_scope,
        get_chunk,
        get_segments,
        is_enabled,
        reset_peak_stats,
        set_limit,
        set_release_threshold,
        set_mem_info_view,
        set_segments,
        stats,
    )
    from gpumem.regions import drop_backups, pause, paused, prepare_backups, region, resume
    from gpumem.monitoring import metrics, pressure, publish, published, reporting, timeline, top
    from gpumem.monitoring.metrics import serve_metrics
    from gpumem.monitoring.pressure import on_pressure
    from gpumem.monitoring.reporting import Report, collect as report
    from gpumem.trace import replay, snapshot_file

    # Their paths before the subpackages (gpumem.metrics, gpumem.replay, ...), which users' code
    # imports: the same module under both names.
    sys.modules.update({f"gpumem.{module.__name__.rpartition('.')[2]}": module for module in (
        metrics, pressure, publish, published, replay, reporting, snapshot_file, timeline, top)})

__all__ = [
    "Report",
    "device_mem_info",
    "drop_backups",
    "empty_cache",
    "enable",
    "get_limit",
    "get_scope",
    "get_chunk",
    "get_segments",
    "is_enabled",
    "on_pressure",
    "pause",
    "paused",
    "prepare_backups",
    "region",
    "report",
    "reset_peak_stats",
    "resume",
    "serve_metrics",
    "set_limit",
    "set_mem_info_view",
    "set_release_threshold",
    "set_segments",
    "stats",
    "timeline",
]
