"""A report of memory use per device: text for a terminal, HTML for Jupyter, a plot over time.

A Report is built from values, so it works without a GPU: `Report.from_stats` takes a dict per
device, `Report.from_sim` reads a simulated allocator, and `collect` reads gpumem's allocator in
this process. Per device it shows allocated and reserved bytes (current and peak), inactive split
bytes, the limit, the segment kind in effect (growable or plain), the largest free cached block,
the device's total and free memory, the failure and release counters, and an estimate of the
memory this process holds outside PyTorch's allocator: device used (total - free) minus reserved.
That estimate also counts the CUDA context, libraries' workspaces and every other process on the
device, so it is labelled as one.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

import gpumem._C as _C
from gpumem.settings import scope as _scope, segments as _segments, sizes
from gpumem.settings.echo import shown

OUTSIDE_NOTE = (
    "estimate: device used (total - free) minus reserved; the CUDA context, libraries and other "
    "processes on the device count too"
)
_BAR_WIDTH_PX = 360


@dataclass
class DeviceReport:
    device: int
    stats: Mapping[str, int]
    limit: Optional[int] = None
    total: Optional[int] = None
    free: Optional[int] = None
    largest_free_block: Optional[int] = None
    timeline: list = field(default_factory=list)  # [(seconds, allocated, reserved)]
    simulated: bool = False  # a simulated device: nothing outside gpumem uses it
    segments: Optional[str] = None  # the segment kind in effect: "growable" or "plain"
    scope: Optional[str] = None  # what the limit bounds: "allocator" or "process" (gpumem.set_limit)
    outside: Optional[int] = None  # under "process": the memory outside gpumem counted against the limit
    outside_source: Optional[str] = None  # where `outside` was measured from (docs/usage.md)
    paused: int = 0  # bytes paused regions gave back (gpumem.pause)

    def stat(self, key: str) -> int:
        return int(self.stats.get(key, 0))

    @property
    def allocated(self) -> int:
        return self.stat("allocated_bytes.all.current")

    @property
    def reserved(self) -> int:
        return self.stat("reserved_bytes.all.current")

    @property
    def outside_estimate(self) -> Optional[int]:
        """Device used minus reserved, when the device's total and free memory are known."""
        if self.simulated or self.total is None or self.free is None:
            return None
        return max(0, self.total - self.free - self.reserved)


class Report:
    def __init__(self, devices: Iterable[DeviceReport], title: str = "gpumem memory report"):
        self.devices = list(devices)
        self.title = title

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_stats(cls, per_device: Union[Mapping[int, Mapping], Sequence[Mapping]],
                   title: str = "gpumem memory report") -> "Report":
        """From {device: {"stats": {...}, "limit", "total", "free", "largest_free_block",
        "timeline", "segments", "scope", "outside", "outside_source", "paused"}} (or a list by device
        index); every key but "stats" is optional."""
        items = per_device.items() if isinstance(per_device, Mapping) else enumerate(per_device)
        devices = []
        for device, values in items:
            if "stats" not in values:
                raise ValueError(f"gpumem: the values for device {shown(device)} have no 'stats' dict")
            devices.append(DeviceReport(
                device=int(device),
                stats=dict(values["stats"]),
                limit=values.get("limit"),
                scope=values.get("scope"),
                outside=values.get("outside"),
                outside_source=values.get("outside_source"),
                paused=values.get("paused", 0),
                total=values.get("total"),
                free=values.get("free"),
                largest_free_block=values.get("largest_free_block"),
                timeline=list(values.get("timeline") or []),
                simulated=bool(values.get("simulated", False)),
                segments=values.get("segments"),
            ))
        return cls(devices, title)

    @classmethod
    def from_sim(cls, sim, devices: Union[int, Iterable[int]] = 1, total: Optional[int] = None,
                 title: str = "gpumem memory report (simulated device)") -> "Report":
        """From a `_C.SimAllocator`: `devices` is a count or the indices; `total` is the capacity
        it was made with (the sim does not say), without which total and free show as unknown."""
        indices = range(devices) if isinstance(devices, int) else devices
        return cls.from_stats({d: {
            "stats": sim.stats(d),
            "limit": sim.get_limit(d),
            "total": total,
            "free": None if total is None else total - sim.reserved(d),
            "largest_free_block": sim.largest_free_block(d),
            "simulated": True,
            "segments": _segments.kind(sim.growable(d)),
            "scope": sim.get_scope(d),
            "outside": sim.outside(d),
            "outside_source": sim.outside_source(d),
            "paused": sim.device_figures(d, False)["paused"],
        } for d in indices}, title)

    # ---- rendering ----------------------------------------------------------------------------

    def __str__(self) -> str:
        lines = [self.title]
        if not self.devices:
            lines.append("  no CUDA device was found")
        for d in self.devices:
            lines += [f"device {d.device}", *_aligned(_rows(d))]
        if any(d.outside_estimate is not None for d in self.devices):
            lines.append(f"* {OUTSIDE_NOTE}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        parts = ['<div class="gpumem-report" style="font-family:monospace">',
                 f"<div><b>{html.escape(self.title)}</b></div>"]
        if not self.devices:
            parts.append("<div>no CUDA device was found</div>")
        for d in self.devices:
            parts += [_html_table(d), _html_bar(d)]
        if any(d.outside_estimate is not None for d in self.devices):
            parts.append(f'<div style="font-size:smaller">* {html.escape(OUTSIDE_NOTE)}</div>')
        parts.append("</div>")
        return "\n".join(parts)

    def plot(self, path=None):
        """Allocated, reserved and the limit against time, one panel per device with a timeline.

        Saves a PNG at `path` when given; returns the matplotlib Figure either way.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ImportError("gpumem: Report.plot needs matplotlib: pip install matplotlib") from None
        drawn = [d for d in self.devices if d.timeline]
        if not drawn:
            raise ValueError(f"gpumem: this report has no timeline to plot; {self._how_to_get_a_timeline()}")
        figure = Figure(figsize=(8, 3 * len(drawn)), layout="constrained")
        for axes, d in zip(figure.subplots(len(drawn), 1, squeeze=False)[:, 0], drawn):
            _plot_device(axes, d)
        if path is not None:
            figure.savefig(path, format="png", dpi=100)
        return figure

    def _how_to_get_a_timeline(self) -> str:
        """Advice that fits where the report came from: a simulated device (a replay's, or a
        SimAllocator's) or this process's devices."""
        if self.devices and all(d.simulated for d in self.devices):
            return ("a simulated device's timeline comes from a replay that walks a trace with events: "
                    "plot gpumem.replay.replay(snapshot, limit).report()")
        from gpumem.monitoring import timeline

        stopped = timeline.error()
        if stopped is not None:
            return f"the timeline stopped recording on an error ({stopped}) before it took a point"
        return "record one with gpumem.timeline.start() before the work, and gpumem.timeline.stop() after it"


# ---- live collection ----------------------------------------------------------------------------


def collect(device=None) -> Report:
    """The report of gpumem's allocator in this process: every visible device, or `device`."""
    # devices and timeline import torch; the rest of this module need not
    from gpumem.monitoring import timeline
    from gpumem.settings import devices as _devices

    indices = range(_C.device_count()) if device is None else [_devices.index(device)]
    per_device = {}
    for d in indices:
        free, total = _C.mem_info(d)
        per_device[d] = {"stats": _C.stats(d), "limit": _C.get_limit(d), "total": total, "free": free,
                         "largest_free_block": _C.largest_free_block(d), "timeline": timeline.points(d),
                         "segments": _segments.kind(_C.get_growable(d)), "scope": _C.get_scope(d),
                         "outside": _C.outside(d), "outside_source": _C.outside_source(d),
                         "paused": _C.paused_bytes(d)[0]}
    return Report.from_stats(per_device)


# ---- helpers ------------------------------------------------------------------------------------


def _size(n: Optional[int]) -> str:
    return "unknown" if n is None else sizes.format_bytes(int(n))


def _rows(d: DeviceReport) -> list[tuple[str, str, str]]:
    """(label, current, peak) for one device."""
    return [
        ("", "current", "peak"),
        ("allocated", _size(d.allocated), _size(d.stat("allocated_bytes.all.peak"))),
        ("reserved", _size(d.reserved), _size(d.stat("reserved_bytes.all.peak"))),
        ("inactive split", _size(d.stat("inactive_split_bytes.all.current")),
         _size(d.stat("inactive_split_bytes.all.peak"))),
        ("limit, whole process" if d.scope == _scope.PROCESS else "limit", _size(d.limit), ""),
    ] + ([("paused", _size(d.paused), "")] if d.paused else []) + ([("outside gpumem, counted", _size(d.outside), d.outside_source or "")]
         if d.scope == _scope.PROCESS else []) + (
        [] if d.segments is None else [("segments", d.segments, "")]) + [
        ("largest free block", _size(d.largest_free_block), ""),
        ("device total", _size(d.total), ""),
        ("device free", _size(d.free), ""),
    ] + ([] if d.simulated else [("outside PyTorch*", _size(d.outside_estimate), "")]) + [
        ("OOMs", str(d.stat("num_ooms")), ""),
        ("alloc retries", str(d.stat("num_alloc_retries")), ""),
        ("cache releases", str(d.stat("num_cache_releases")), ""),
    ]


def _aligned(rows: list[tuple[str, str, str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return [f"  {label:<{widths[0]}}  {now:>{widths[1]}}  {peak:>{widths[2]}}".rstrip()
            for label, now, peak in rows]


def _html_table(d: DeviceReport) -> str:
    cell = 'style="text-align:right;padding:0 0.8em"'
    head, *rows = _rows(d)
    lines = [f'<table class="gpumem-device" data-device="{d.device}" style="border-collapse:collapse">',
             f'<caption style="text-align:left">device {d.device}</caption>',
             f"<tr><th></th><th {cell}>{head[1]}</th><th {cell}>{head[2]}</th></tr>"]
    for label, now, peak in rows:
        lines.append(f'<tr><th style="text-align:left">{html.escape(label)}</th>'
                     f"<td {cell}>{html.escape(now)}</td><td {cell}>{html.escape(peak)}</td></tr>")
    lines.append("</table>")
    return "\n".join(lines)


def _html_bar(d: DeviceReport) -> str:
    """Allocated inside reserved inside the limit; both widths are in % of the limit. A legend
    under the bar names the three, with their sizes.

    The outer div is the positioned ancestor of the allocated div (the reserved div is not
    positioned), so the allocated div's width is also a share of the limit."""
    scale = d.limit or d.total or max(d.reserved, 1)

    def share(n: int) -> str:
        return f"{min(100.0, 100.0 * n / scale):.2f}%"

    name = "limit" if d.limit else "device total" if d.total else "reserved"
    bar = (
        f'<div class="gpumem-limit" title="{name} {_size(scale)}" style="position:relative;'
        f'width:{_BAR_WIDTH_PX}px;height:14px;margin:4px 0 2px 0;border:1px solid #555;background:#eee">'
        f'<div class="gpumem-reserved" title="reserved {_size(d.reserved)}" '
        f'style="width:{share(d.reserved)};height:100%;background:#a6cee3">'
        f'<div class="gpumem-allocated" title="allocated {_size(d.allocated)}" style="position:absolute;'
        f'left:0;top:0;width:{share(d.allocated)};height:100%;background:#1f78b4"></div></div></div>'
    )
    keys = [("#1f78b4", "allocated", d.allocated), ("#a6cee3", "reserved", d.reserved), ("#eee", name, scale)]
    legend = "&nbsp;&nbsp;".join(
        f'<span style="display:inline-block;width:10px;height:10px;border:1px solid #555;background:{color}">'
        f"</span>&nbsp;{label} {_size(n)}" for color, label, n in keys)
    return f'{bar}\n<div class="gpumem-legend" style="font-size:smaller;margin:0 0 12px 0">{legend}</div>'


def _plot_device(axes, d: DeviceReport) -> None:
    highest = max([d.limit or 0] + [max(a, r) for _, a, r in d.timeline])
    unit, name = next((u, n) for u, n in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "bytes"))
                      if highest >= u or u == 1)
    seconds = [t for t, _, _ in d.timeline]
    axes.plot(seconds, [a / unit for _, a, _ in d.timeline], drawstyle="steps-post", label="allocated")
    axes.plot(seconds, [r / unit for _, _, r in d.timeline], drawstyle="steps-post", label="reserved")
    if d.limit:
        axes.axhline(d.limit / unit, color="tab:red", linestyle="--", label="limit")
    axes.set_title(f"device {d.device}")
    axes.set_xlabel("seconds")
    axes.set_ylabel(name)
    axes.set_ylim(0, max(highest, 1) / unit * 1.08)  # headroom: the limit line sits below the frame
    axes.legend(loc="best")
