"""The environment's settings, handed to gpumem when it is installed.

    GPUMEM_LIMIT     the limits: "4GB" for every device, or per device "0:4GB,1:8GB"
    GPUMEM_SEGMENTS  the segment kind on every device: "growable" or "plain"
    GPUMEM_CHUNK     the least chunk growable segments map for large requests: "16MB" (default: pages)
    GPUMEM_SCOPE     what the limits bound on every device: "allocator" (the default) or "process"
    GPUMEM_MEM_INFO  what torch.cuda.mem_get_info reports: "capped" (the default) or "device"
    GPUMEM_WARN_AT   a warning each time reserved passes this share of the limit (gpumem.pressure)
    GPUMEM_METRICS_PORT  Prometheus metrics on this port plus LOCAL_RANK (gpumem.metrics)
    GPUMEM_METRICS_ADDR  ... at this address (default 127.0.0.1: this machine only)
    GPUMEM_PUBLISH   "0": no figures published for `gpumem top` (default "1"; gpumem.monitoring.publish)
    GPUMEM_RUN_DIR   where they are published, and read (default /tmp/gpumem-<uid>)
    GPUMEM_SHARE     "on": share the GPU with other gpumem processes (gpumem.sharing)
    GPUMEM_FLOOR     a floor that they leave this process: "20GB", or per device "0:20GB,1:8GB"

Installing touches no CUDA: the syntax is checked then (`limit_text`), and what depends on the
devices (a percentage, a device number, a size above a device's memory) when the devices are first
used, by the compiled layer (csrc/torch/startup.h).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

import gpumem._C as _C
from gpumem.settings import (chunk as _chunk, floors, limits, mem_info, metrics_endpoint, pressure_share,
                             scope as _scope, segments as _segments)
from gpumem.settings.echo import bounded, shown
from gpumem.settings.run_dir import RunDir, default_run_dir
from gpumem.settings.words import not_utf8

VARIABLE = "GPUMEM_LIMIT"
SEGMENTS_VARIABLE = "GPUMEM_SEGMENTS"
CHUNK_VARIABLE = "GPUMEM_CHUNK"
SCOPE_VARIABLE = "GPUMEM_SCOPE"
MEM_INFO_VARIABLE = "GPUMEM_MEM_INFO"
WARN_AT_VARIABLE = "GPUMEM_WARN_AT"
METRICS_PORT_VARIABLE = "GPUMEM_METRICS_PORT"
METRICS_ADDR_VARIABLE = "GPUMEM_METRICS_ADDR"
PUBLISH_VARIABLE = "GPUMEM_PUBLISH"
RUN_DIR_VARIABLE = "GPUMEM_RUN_DIR"
_PUBLISH_FORMS = '"1" (publish, the default) or "0" (do not)'
_RUN_DIR_FORMS = "an absolute path of a directory"


class SettingError(ValueError):
    """A variable's value that gpumem refuses; `reason` says why without naming the two."""

    def __init__(self, variable: str, text: str, reason: str):
        reason = bounded(reason)
        super().__init__(f"gpumem: {variable}={shown(text)} cannot be applied: {reason}")
        self.variable, self.text, self.reason = variable, text, reason


def limit_text(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """GPUMEM_LIMIT's value (None when unset), its syntax checked without asking any device; a bad
    one raises SettingError (a ValueError) naming the variable, its value and the accepted forms."""
    text = environ.get(VARIABLE)
    if text is not None:
        resolve_limit(text)
    return text


def resolve_limit(text: str, totals: Optional[Sequence[int]] = None) -> Optional[list[Optional[int]]]:
    """GPUMEM_LIMIT=`text` on devices of these totals in bytes: each one's limit (None for none),
    as the compiled layer applies it at their first use; for totals None, its syntax alone is
    checked and None returned. What cannot be applied raises SettingError. The one check of
    GPUMEM_LIMIT: the hook, enable() and `gpumem info` give the same verdict."""
    problem = not_utf8(text)
    if problem is not None:  # the compiled layer takes UTF-8 only
        raise SettingError(VARIABLE, text, f"{problem}. Accepted forms: {_C.limit_forms}")
    try:
        if totals is not None:
            return _C.resolve_limit_text(text, list(totals))
        for _, spec in _C.parse_limit_assignments(text):
            limits.check_syntax(spec)
    except _C.LimitSpecError as error:
        raise SettingError(VARIABLE, text, limits.reason(error)) from None
    return None


def segments(environ: Mapping[str, str] = os.environ) -> Optional[bool]:
    """Whether GPUMEM_SEGMENTS asks for growable segments; None when it is unset. A bad value
    raises SettingError naming the variable, its value and the accepted forms."""
    return _setting(environ, SEGMENTS_VARIABLE, _segments.growable, _segments.FORMS)


def chunk(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """GPUMEM_CHUNK's bytes (gpumem.settings.chunk); None when it is unset. A bad value raises
    SettingError as segments() does."""
    return _setting(environ, CHUNK_VARIABLE, _chunk.chunk_bytes, _chunk.FORMS)


def scope(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """GPUMEM_SCOPE's limit scope ("allocator" or "process"); None when it is unset. A bad value
    raises SettingError as segments() does."""
    return _setting(environ, SCOPE_VARIABLE, _scope.scope, _scope.FORMS)


def mem_info_view(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """GPUMEM_MEM_INFO's view of torch.cuda.mem_get_info; None when it is unset. A bad value raises
    SettingError as segments() does."""
    return _setting(environ, MEM_INFO_VARIABLE, mem_info.view, mem_info.FORMS)


def warn_at(environ: Mapping[str, str] = os.environ) -> Optional[float]:
    """GPUMEM_WARN_AT's share of the limit; None when unset. A bad value raises as segments() does."""
    return _setting(environ, WARN_AT_VARIABLE, pressure_share.share_of_text, pressure_share.SHARE_FORMS)


def metrics_port(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """GPUMEM_METRICS_PORT's base port; None when unset. A bad value raises as segments() does."""
    return _setting(environ, METRICS_PORT_VARIABLE, metrics_endpoint.port_of_text, metrics_endpoint.PORT_FORMS)


def metrics_addr(environ: Mapping[str, str] = os.environ) -> str:
    """GPUMEM_METRICS_ADDR's address, else 127.0.0.1. A bad value raises as segments() does."""
    addr = _setting(environ, METRICS_ADDR_VARIABLE, metrics_endpoint.addr_of_text, metrics_endpoint.ADDR_FORMS)
    return metrics_endpoint.DEFAULT_ADDR if addr is None else addr


def publish_dir(environ: Mapping[str, str] = os.environ) -> Optional[RunDir]:
    """Where the process publishes its figures for `gpumem top`; None with GPUMEM_PUBLISH=0. A bad
    GPUMEM_PUBLISH or GPUMEM_RUN_DIR raises as segments() does."""
    on = _setting(environ, PUBLISH_VARIABLE, _publish_of_text, _PUBLISH_FORMS)
    where = run_dir(environ)
    return None if on is False else where


def run_dir(environ: Mapping[str, str] = os.environ) -> RunDir:
    """GPUMEM_RUN_DIR, else the default run directory. A bad value raises as segments() does."""
    path = _setting(environ, RUN_DIR_VARIABLE, _run_dir_of_text, _RUN_DIR_FORMS, any_bytes=True)
    return default_run_dir() if path is None else RunDir(path, chosen=True)


def share(environ: Mapping[str, str] = os.environ) -> Optional[bool]:
    """GPUMEM_SHARE's choice; None when unset. A bad value raises as segments() does."""
    return _setting(environ, floors.SHARE_VARIABLE, floors.share_of_text, floors.SHARE_FORMS)


def floor(environ: Mapping[str, str] = os.environ) -> Optional[list]:
    """GPUMEM_FLOOR's (device, spec) pairs (-1: every device), their syntax checked; None when
    unset. A bad value raises SettingError naming the variable, its value and the accepted forms."""
    text = environ.get(floors.FLOOR_VARIABLE)
    if text is None:
        return None
    problem = not_utf8(text)
    if problem is not None:
        raise SettingError(floors.FLOOR_VARIABLE, text, f"{problem}. Accepted forms: {floors.floor_forms()}")
    try:
        return floors.floor_assignments(text)
    except floors.FloorError as error:
        raise SettingError(floors.FLOOR_VARIABLE, text, f"{error.reason}. Accepted forms: {floors.floor_forms()}") from None


def sharing_asked(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the process joins its GPUs' tables at the first CUDA use: GPUMEM_SHARE=on, or a
    GPUMEM_FLOOR. A bad value of either raises SettingError as segments() does."""
    return bool(share(environ)) or floor(environ) is not None


def _publish_of_text(text: str) -> bool:
    if text.strip() not in ("0", "1"):
        raise ValueError(text)
    return text.strip() == "1"


def _run_dir_of_text(text: str) -> str:
    # Relative, it would name another directory in each working directory.
    if not os.path.isabs(text) or "\0" in text or len(text) > 4096:
        raise ValueError(text)
    return os.path.normpath(text)


def _setting(environ: Mapping[str, str], variable: str, parse, forms: str, any_bytes: bool = False):
    """`variable`'s value read by `parse`, None when unset; SettingError naming it and `forms` if
    `parse` refuses it (saying so when it holds bytes that are not UTF-8, unless `any_bytes`: a path
    may hold any)."""
    text = environ.get(variable)
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError:
        problem = None if any_bytes else not_utf8(text)
        raise SettingError(variable, text, f"give {forms}" if problem is None else f"{problem}; give {forms}") from None


# The settings besides GPUMEM_LIMIT, each with the reader that checks it: the hook stops on a bad
# one and `gpumem info` reports it, from this one list. publish_dir reads GPUMEM_RUN_DIR as well.
SETTINGS = (
    (SEGMENTS_VARIABLE, segments),
    (CHUNK_VARIABLE, chunk),
    (SCOPE_VARIABLE, scope),
    (MEM_INFO_VARIABLE, mem_info_view),
    (WARN_AT_VARIABLE, warn_at),
    (METRICS_PORT_VARIABLE, metrics_port),
    (METRICS_ADDR_VARIABLE, metrics_addr),
    (PUBLISH_VARIABLE, publish_dir),
    (floors.SHARE_VARIABLE, share),
    (floors.FLOOR_VARIABLE, floor),
)
