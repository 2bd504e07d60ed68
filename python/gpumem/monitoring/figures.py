"""Every figure gpumem shows about a device, defined once: its name in each view, its meaning, and
how it is read from the device's figures (`device_figures(device)` of gpumem._C or a
SimAllocator: reserved, limit, stats, outside, sharing, ...).

The Prometheus metrics (gpumem.metrics), the file each process publishes for `gpumem top`
(gpumem.monitoring.publish, read back by gpumem.monitoring.published) and top's JSON all derive from FIGURES, so a
figure cannot be in one view and missing from another, nor read two ways.

Note [which reserved]
  Reserved is one figure: what the device handed gpumem (segments, mapped pages, and memory handed
  out while caching is off: Note [caching off in the statistics], core/uncached.h), read from the
  statistics (reserved_bytes.all.current) with its peak, so the report, memory_stats, the timeline,
  the metrics and gpumem top show the same value, and never a peak below it.
  What the limit measures is another figure, "counted" (the cap's, core/cap.h): reserved, plus under
  a limit on the whole process (GPUMEM_SCOPE=process) the process's memory outside gpumem. It has a
  name and a peak of its own everywhere it is shown (gpumem_counted_bytes, gpumem_counted_peak_bytes,
  top's counted_bytes), and the share of the limit is its.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

OOM_CASES = {  # the label `case` of gpumem_ooms_total -> the statistic that counts it
    "over_limit": "num_ooms_over_limit",
    "device_full": "num_ooms_device_full",
    "fragmentation": "num_ooms_fragmentation",
}

# A figure's value for one device: a count; a {label value: count}, one count per value of its
# label; or None where the device has none (not measured, not sharing).
Value = Union[int, dict, None]


@dataclass(frozen=True)
class Figure:
    """One figure. `key`: its name in the published file and in top (None: not published, the
    metrics alone show it); `metric`: its Prometheus name; `document`: its name in `gpumem top
    --json`, the metric's without "gpumem_"; `label`: the metric's extra label, its value either
    read by `label_of` (a figure that is one count) or the keys of the {label value: count} the
    figure is, which are `label_values` (a published file holds a count for each); `default`: what the figure is where `read` gives None, and what a published file
    without it reads as (None: not published there, and the file must hold it, unless `older` says
    how an older gpumem's file, written before the figure was, reads: from its other figures)."""
    metric: str
    kind: str  # "gauge" or "counter"
    help: str
    read: Callable[[dict], Value]
    key: Optional[str] = None
    label: Optional[str] = None
    label_of: Optional[Callable[[dict], str]] = None
    label_values: tuple = ()
    default: Optional[int] = None
    older: Optional[Callable[[dict], int]] = None

    @property
    def document(self) -> str:
        return self.metric.removeprefix("gpumem_")


def reserved(figures: dict) -> int:
    """What the device handed gpumem: Note [which reserved]. device_figures reads it from the
    statistics (reserved_bytes.all.current), in the same read as its peak."""
    return figures["reserved"]


def _stat(key: str) -> Callable[[dict], int]:
    return lambda figures: figures["stats"][key]


def _sharing(key: str) -> Callable[[dict], Optional[int]]:
    return lambda figures: figures["sharing"][key] if figures.get("sharing") else None


def _counted(figures: dict) -> int:
    return figures["counted"]  # reserved + outside, which is 0 but under a limit on the whole process


def _process_outside(figures: dict) -> Optional[int]:
    # Measured only ever under a limit on the whole process.
    return None if figures["outside_source"] == "none" else figures["outside"]


def _device_outside(figures: dict) -> Optional[int]:
    if figures["device_free"] is None:  # the device was not asked, or could not say
        return None
    return max(figures["device_total"] - figures["device_free"] - reserved(figures), 0)


FIGURES = (
    Figure("gpumem_allocated_bytes", "gauge", "Bytes in blocks handed out to PyTorch (torch.cuda.memory_allocated).",
           _stat("allocated_bytes.all.current"), key="allocated"),
    Figure("gpumem_allocated_peak_bytes", "gauge", "The most allocated since the start or the last peak reset.",
           _stat("allocated_bytes.all.peak"), key="allocated_peak"),
    Figure("gpumem_reserved_bytes", "gauge",
           "Bytes the device handed gpumem (torch.cuda.memory_reserved): segments, and memory handed out while "
           "caching is off.",
           reserved, key="reserved"),
    Figure("gpumem_reserved_peak_bytes", "gauge", "The most reserved since the start or the last peak reset.",
           _stat("reserved_bytes.all.peak"), key="reserved_peak"),
    Figure("gpumem_limit_bytes", "gauge",
           "The cap: on reserved bytes, or under a limit on the whole process on gpumem_counted_bytes.",
           lambda figures: figures["limit"], key="limit"),
    Figure("gpumem_counted_bytes", "gauge",
           "What the limit measures: reserved, plus the process's memory outside gpumem under a limit on the "
           "whole process (GPUMEM_SCOPE=process).", _counted, key="counted",
           older=lambda device: device["reserved"] + device["outside"]),
    Figure("gpumem_counted_peak_bytes", "gauge", "The most counted since the start or the last peak reset.",
           lambda figures: figures["counted_peak"], key="counted_peak",
           older=lambda device: device["reserved_peak"] + device["outside"]),
    Figure("gpumem_free_under_limit_bytes", "gauge",
           "Bytes gpumem may still reserve before the limit refuses: limit - reserved (- the process's memory "
           "outside gpumem under a limit on the whole process), 0 above a lowered limit.",
           lambda figures: max(figures["limit"] - _counted(figures), 0)),
    # Published as "outside", 0 under the allocator scope: top's share of the limit counts it.
    Figure("gpumem_process_outside_bytes", "gauge",
           "Under a limit on the whole process: the process's device memory outside gpumem (CUDA context, "
           "libraries), as last measured and counted against the limit; source: where it was measured from "
           "(process accounting, or the device at first use).", _process_outside, key="outside",
           label="source", label_of=lambda figures: figures["outside_source"], default=0),
    Figure("gpumem_outside_bytes", "gauge",
           "Device memory in use that gpumem did not reserve (other processes, CUDA contexts, other allocators): "
           "device total - device free - reserved, from cudaMemGetInfo.", _device_outside),
    Figure("gpumem_paused_bytes", "gauge",
           "Bytes paused regions gave back to the device (gpumem.pause): not reserved while paused, mapped again "
           "at resume.", lambda figures: figures.get("paused", 0), key="paused", default=0),
    Figure("gpumem_ooms", "counter", "Requests gpumem refused with out-of-memory, by case.",
           lambda figures: {case: figures["stats"][stat] for case, stat in OOM_CASES.items()}, key="ooms",
           label="case", label_values=tuple(OOM_CASES)),
    Figure("gpumem_alloc_retries", "counter", "Requests that released cached memory and tried again.",
           _stat("num_alloc_retries")),
    Figure("gpumem_cache_releases", "counter", "Times cached memory was given back to the device.",
           _stat("num_cache_releases")),
    Figure("gpumem_floor_bytes", "gauge",
           "Sharing the GPU (GPUMEM_FLOOR, GPUMEM_SHARE): the floor the other gpumem processes leave this one.",
           _sharing("floor"), key="floor", default=0),
    Figure("gpumem_borrowed_bytes", "gauge", "Sharing the GPU: reserved above the floor (lent by the others).",
           _sharing("borrowed"), key="borrowed", default=0),
    Figure("gpumem_floor_short_bytes", "gauge",
           "Sharing the GPU: how much of the floor the device cannot give now (others' live tensors hold it).",
           _sharing("floor_short")),
    Figure("gpumem_given_back_bytes", "counter", "Sharing the GPU: bytes of free cache released because another asked.",
           _sharing("given_back"), key="given_back", default=0),
    Figure("gpumem_releases_on_request", "counter", "Sharing the GPU: other processes' requests this one answered.",
           _sharing("asks_served"), key="asks_served", default=0),
    Figure("gpumem_requests_made", "counter", "Sharing the GPU: times this process asked the others for their free cache.",
           _sharing("asks_made")),
)

# Counted by the allocator per watched share rather than read from a device's figures
# (pressure_crossings() of gpumem._C or a SimAllocator); listed here so the metrics describe it.
PRESSURE_CROSSINGS = Figure(
    "gpumem_pressure_crossings", "counter",
    "Times reserved passed a watched share of the limit (gpumem.on_pressure, GPUMEM_WARN_AT).",
    lambda figures: None, label="share")

PUBLISHED = tuple(figure for figure in FIGURES if figure.key is not None)


def published_value(figure: Figure, figures: dict) -> Value:
    """What the published file holds for `figure` of a device with these figures."""
    value = figure.read(figures)
    return figure.default if value is None else value
