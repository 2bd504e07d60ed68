"""Prometheus metrics of gpumem's devices: `gpumem.serve_metrics(port)` and GPUMEM_METRICS_PORT.

    server = gpumem.serve_metrics(9400)          # http://127.0.0.1:9400/metrics
    registry.register(gpumem.metrics.Collector())  # or into a registry of one's own

Needs prometheus_client (`pip install prometheus_client`, or the extra `gpumem[metrics]`); without
it serve_metrics and Collector raise MetricsUnavailable, an ImportError that says so. The figures
are read at each scrape, per device in use: reserved and the limit without the allocator's lock,
the rest from one copy of the statistics; every sample carries the labels device, pid and job
(GPUMEM_JOB, else the program's name; any text, escaped by label_value). A device nobody has used yet is not reported: asking it
would start CUDA. The metrics and their meanings are listed in docs/monitoring.md (METRICS below).

GPUMEM_METRICS_PORT (see serve_for_environment) is a base port: each process serves on
(base + LOCAL_RANK), LOCAL_RANK 0 when unset, so the ranks of a torchrun job on one node take
consecutive ports, at GPUMEM_METRICS_ADDR (default 127.0.0.1: this machine only; 0.0.0.0 for a
container whose port is published, which opens the figures to whoever reaches it). gpumem._monitoring opens it when the process first initializes CUDA, so a
launcher (torchrun itself) and DataLoader workers, which never do, hold no port. What stops it (the port in use,
prometheus_client missing) is one line on stderr, and the program goes on: the cap matters more
than the metrics.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import re
import sys
from typing import Mapping, Optional, Sequence

from gpumem import _C, _http
from gpumem._words import shown

JOB_VARIABLE = "GPUMEM_JOB"
RANK_VARIABLE = "LOCAL_RANK"
DEFAULT_ADDR = "127.0.0.1"
PORT_FORMS = "a port number in 1..65535 (each process serves on it plus LOCAL_RANK)"
ADDR_FORMS = ("an address to listen on: an IP address of this machine such as 127.0.0.1 (the default: this "
              "machine only) or 0.0.0.0 (every interface: the network), :: or ::1 for IPv6, or a host name")
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
OOM_CASES = {  # the label `case` of gpumem_ooms_total -> the statistic that counts it
    "over_limit": "num_ooms_over_limit",
    "device_full": "num_ooms_device_full",
    "fragmentation": "num_ooms_fragmentation",
}
_LABELS = ("device", "pid", "job")
_MAX_LABEL = 128
_TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes
_INSTALL = "pip install prometheus_client (or pip install 'gpumem[metrics]')"

# (name, kind, help, extra label). The values are read in Collector._device_samples.
METRICS = (
    ("gpumem_allocated_bytes", "gauge", "Bytes in blocks handed out to PyTorch (torch.cuda.memory_allocated).", None),
    ("gpumem_allocated_peak_bytes", "gauge", "The most allocated since the start or the last peak reset.", None),
    ("gpumem_reserved_bytes", "gauge",
     "Bytes gpumem holds from the device, counted against the limit (torch.cuda.memory_reserved).", None),
    ("gpumem_reserved_peak_bytes", "gauge", "The most reserved since the start or the last peak reset.", None),
    ("gpumem_limit_bytes", "gauge",
     "The cap: on reserved bytes, or under a limit on the whole process on gpumem_counted_bytes.", None),
    ("gpumem_counted_bytes", "gauge",
     "What the limit measures: reserved, plus the process's memory outside gpumem under a limit on the "
     "whole process (GPUMEM_SCOPE=process).", None),
    ("gpumem_free_under_limit_bytes", "gauge",
     "Bytes gpumem may still reserve before the limit refuses: limit - reserved (- the process's memory "
     "outside gpumem under a limit on the whole process), 0 above a lowered limit.", None),
    ("gpumem_process_outside_bytes", "gauge",
     "Under a limit on the whole process: the process's device memory outside gpumem (CUDA context, "
     "libraries), as last measured and counted against the limit; source: where it was measured from "
     "(process accounting, or the device at first use).", "source"),
    ("gpumem_outside_bytes", "gauge",
     "Device memory in use that gpumem did not reserve (other processes, CUDA contexts, other allocators): "
     "device total - device free - reserved, from cudaMemGetInfo.", None),
    ("gpumem_ooms", "counter", "Requests gpumem refused with out-of-memory, by case.", "case"),
    ("gpumem_alloc_retries", "counter", "Requests that released cached memory and tried again.", None),
    ("gpumem_cache_releases", "counter", "Times cached memory was given back to the device.", None),
    ("gpumem_pressure_crossings", "counter",
     "Times reserved passed a watched share of the limit (gpumem.on_pressure, GPUMEM_WARN_AT).", "share"),
    ("gpumem_floor_bytes", "gauge",
     "Sharing the GPU (GPUMEM_FLOOR, GPUMEM_SHARE): the floor the other gpumem processes leave this one.", None),
    ("gpumem_borrowed_bytes", "gauge", "Sharing the GPU: reserved above the floor (lent by the others).", None),
    ("gpumem_floor_short_bytes", "gauge",
     "Sharing the GPU: how much of the floor the device cannot give now (others' live tensors hold it).", None),
    ("gpumem_given_back_bytes", "counter", "Sharing the GPU: bytes of free cache released because another asked.",
     None),
    ("gpumem_releases_on_request", "counter", "Sharing the GPU: other processes' requests this one answered.", None),
    ("gpumem_requests_made", "counter",
     "Sharing the GPU: times this process asked the others for their free cache.", None),
)


class MetricsUnavailable(ImportError):
    """prometheus_client cannot be imported."""


def _prometheus():
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as error:
        raise MetricsUnavailable(
            f"gpumem: metrics need the prometheus_client package, which cannot be imported ({error}): {_INSTALL}"
        ) from None
    return prometheus_client


def job_name(environ: Mapping[str, str] = os.environ, argv: Optional[Sequence[str]] = None) -> str:
    """The label `job`: GPUMEM_JOB, else the program's name (basename of sys.argv[0])."""
    job = environ.get(JOB_VARIABLE, "").strip()
    if not job:
        argv = sys.argv if argv is None else argv
        job = os.path.basename(argv[0]) if argv else ""
        job = "python" if job in ("", "-c", "-") else job
    return job[:_MAX_LABEL]


class Collector:
    """A prometheus_client collector that reads gpumem's figures at every scrape.

    `source`: None for the process's allocator (gpumem._C), or anything with its
    existing_devices(), device_figures(device) and pressure_crossings(), such as a SimAllocator.
    """

    def __init__(self, source=None, job: Optional[str] = None):
        self._core = _prometheus().core
        self._source = source
        self._job = label_value(job_name() if job is None else str(job))

    def describe(self):
        return list(self._families().values())

    def collect(self):
        source = self._source if self._source is not None else _C
        families = self._families()
        labels = [str(os.getpid()), self._job]
        for device in source.existing_devices():
            for name, value, extra in _device_samples(source.device_figures(device)):
                families[name].add_metric([str(device), *labels, *map(label_value, extra)], value)
        for device, share, crossings, _, _ in source.pressure_crossings():
            families["gpumem_pressure_crossings"].add_metric([str(device), *labels, f"{share:g}"], crossings)
        return list(families.values())

    def _families(self) -> dict:
        kinds = {"gauge": self._core.GaugeMetricFamily, "counter": self._core.CounterMetricFamily}
        return {name: kinds[kind](name, text, labels=[*_LABELS, *([extra] if extra else [])])
                for name, kind, text, extra in METRICS}


def _device_samples(figures: dict):
    """(metric, value, extra label values) of one device's figures."""
    stats, reserved, limit = figures["stats"], figures["reserved"], figures["limit"]
    yield "gpumem_allocated_bytes", stats["allocated_bytes.all.current"], ()
    yield "gpumem_allocated_peak_bytes", stats["allocated_bytes.all.peak"], ()
    yield "gpumem_reserved_bytes", reserved, ()
    yield "gpumem_reserved_peak_bytes", stats["reserved_bytes.all.peak"], ()
    outside = figures["outside"]  # 0 but under a limit on the whole process
    yield "gpumem_limit_bytes", limit, ()
    yield "gpumem_counted_bytes", reserved + outside, ()
    yield "gpumem_free_under_limit_bytes", max(limit - reserved - outside, 0), ()
    if figures["outside_source"] != "none":  # measured: only ever under a limit on the whole process
        yield "gpumem_process_outside_bytes", outside, (figures["outside_source"],)
    if figures["device_free"] is not None:
        used = figures["device_total"] - figures["device_free"]
        yield "gpumem_outside_bytes", max(used - reserved, 0), ()
    for case, stat in OOM_CASES.items():
        yield "gpumem_ooms", stats[stat], (case,)
    yield "gpumem_alloc_retries", stats["num_alloc_retries"], ()
    yield "gpumem_cache_releases", stats["num_cache_releases"], ()
    sharing = figures.get("sharing")
    if sharing:
        yield "gpumem_floor_bytes", sharing["floor"], ()
        yield "gpumem_borrowed_bytes", sharing["borrowed"], ()
        yield "gpumem_floor_short_bytes", sharing["floor_short"], ()
        yield "gpumem_given_back_bytes", sharing["given_back"], ()
        yield "gpumem_releases_on_request", sharing["asks_served"], ()
        yield "gpumem_requests_made", sharing["asks_made"], ()


class MetricsServer:
    """An endpoint serve_metrics opened: `addr`, `port` (the one bound, for a port of 0), `close()`."""

    def __init__(self, server: _http.Server, addr: str):
        self._server = server
        self.addr, self.port = addr, server.port

    def close(self) -> None:
        self._server.close()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpumem MetricsServer http://{self.addr}:{self.port}/metrics>"


def serve_metrics(port: int, addr: str = DEFAULT_ADDR) -> MetricsServer:
    """Serves gpumem's metrics at http://addr:port/metrics from a daemon thread, and returns the server.

    `port` is in 0..65535 (0: any free port; read the returned server's .port). `addr` 127.0.0.1 keeps
    the endpoint on the machine; "0.0.0.0" opens it to the network. One thread serves every client,
    each with 10 seconds in all (gpumem._http, Note [stalled clients]). Starts no CUDA. Raises
    MetricsUnavailable (an ImportError) without prometheus_client, TypeError or ValueError for a bad
    port or address, and OSError naming the address when it cannot be bound (a port in use).
    """
    port, addr = _checked_port(port), _checked_addr(addr)
    client = _prometheus()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(Collector())

    def answer(path: str) -> tuple[int, str, bytes]:
        if path not in ("/metrics", "/"):
            return 404, "text/plain; charset=utf-8", b"gpumem serves its metrics at /metrics\n"
        return 200, _TEXT_FORMAT, client.generate_latest(registry)

    try:
        server = _http.Server(addr, port, answer, name="gpumem-metrics")
    except OSError as error:
        advice = ("; another process (another rank?) may hold the port: pick another"
                  if error.errno == errno.EADDRINUSE else "")
        refused = OSError(f"gpumem: cannot serve metrics on {addr}:{port}: {error.strerror or error}{advice}")
        refused.errno = error.errno  # errno.EADDRINUSE for a port in use
        raise refused from None
    server.start()
    if hasattr(os, "register_at_fork"):
        # A forked child (a DataLoader worker) has no serving thread: it lets go of the port.
        os.register_at_fork(after_in_child=server.close_in_forked_child)
    return MetricsServer(server, addr)


def label_value(text: str) -> str:
    """`text` as a label's value: every character that is not printable written as Python escapes
    it (a byte that was not UTF-8, as "\\udcff"), so that any string is valid UTF-8 on one line; at
    most _MAX_LABEL characters. prometheus_client then escapes backslashes and quotes as the text
    format wants."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text[:_MAX_LABEL])[:_MAX_LABEL]


def port_of_text(text: str) -> int:
    """GPUMEM_METRICS_PORT's base port; ValueError for anything but a number in 1..65535."""
    text = text.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= 65535):
        raise ValueError(f"bad port; give {PORT_FORMS}")
    return int(text)


def addr_of_text(text: str) -> str:
    """GPUMEM_METRICS_ADDR's address; ValueError for anything but an IP address or a host name."""
    text = text.strip()
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        if _HOST_NAME.fullmatch(text) is None:
            raise ValueError(f"bad address; give {ADDR_FORMS}") from None
    return text


def serve_for_environment(base: int, environ: Mapping[str, str] = os.environ,
                          addr: str = DEFAULT_ADDR) -> Optional[MetricsServer]:
    """GPUMEM_METRICS_PORT's endpoint: addr (GPUMEM_METRICS_ADDR's, else 127.0.0.1), port base +
    LOCAL_RANK. Never raises: what stops it is one line on stderr, and None."""
    try:
        port = base + _local_rank(environ)
        if port > 65535:
            raise ValueError(f"port {port} is above 65535")
        return serve_metrics(port, addr)
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


def _checked_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"gpumem: metrics port {shown(port)} ({type(port).__name__}) is not an int; give 0..65535")
    if not 0 <= port <= 65535:
        raise ValueError(f"gpumem: bad metrics port {port}: give 0..65535 (0: any free port)")
    return port


def _checked_addr(addr: object) -> str:
    if not isinstance(addr, str) or not addr or len(addr) > 255:
        raise TypeError(f"gpumem: metrics address {addr!r:.80} is not a host name or IP address; give e.g. "
                        "'127.0.0.1' or '0.0.0.0'")
    return addr
