"""Prometheus metrics of gpumem's devices: `gpumem.serve_metrics(port)` and GPUMEM_METRICS_PORT.

    server = gpumem.serve_metrics(9400)          # http://127.0.0.1:9400/metrics
    registry.register(gpumem.metrics.Collector())  # or into a registry of one's own

Needs prometheus_client (`pip install prometheus_client`, or the extra `gpumem[metrics]`); without
it serve_metrics and Collector raise MetricsUnavailable, an ImportError that says so. The figures
are read at each scrape, per device in use: reserved and the limit without the allocator's lock,
the rest from one copy of the statistics; every sample carries the labels device, pid and job
(GPUMEM_JOB, else the program's name; any text, escaped by label_value). A device nobody has used yet is not reported: asking it
would start CUDA. The metrics are the figures of gpumem.monitoring.figures, which `gpumem top` shows too; their
meanings are listed in docs/monitoring.md.

GPUMEM_METRICS_PORT (see startup.serve_metrics_for_environment) is a base port: each process serves on
(base + LOCAL_RANK), LOCAL_RANK 0 when unset, so the ranks of a torchrun job on one node take
consecutive ports, at GPUMEM_METRICS_ADDR (default 127.0.0.1: this machine only; 0.0.0.0 for a
container whose port is published, which opens the figures to whoever reaches it). gpumem.monitoring.startup opens it when the process first initializes CUDA, so a
launcher (torchrun itself) and DataLoader workers, which never do, hold no port. What stops it (the port in use,
prometheus_client missing) is one line on stderr, and the program goes on: the cap matters more
than the metrics.
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Mapping, Optional, Sequence

import gpumem._C as _C
from gpumem.monitoring import figures as _figures, http_server
from gpumem.settings import metrics_endpoint as endpoint

JOB_VARIABLE = "GPUMEM_JOB"
_LABELS = ("device", "pid", "job")
_MAX_LABEL = 128
_TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes
_INSTALL = "pip install prometheus_client (or pip install 'gpumem[metrics]')"

# Every metric but the pressure crossings is a figure of gpumem.monitoring.figures, read from one device's
# figures; the crossings are counted per watched share.
METRICS = (*_figures.FIGURES, _figures.PRESSURE_CROSSINGS)
OOM_CASES = _figures.OOM_CASES


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
        return {f.metric: kinds[f.kind](f.metric, f.help, labels=[*_LABELS, *([f.label] if f.label else [])])
                for f in METRICS}


def _device_samples(figures: dict):
    """(metric, value, extra label values) of one device's figures, in the order of METRICS."""
    for figure in _figures.FIGURES:
        value = figure.read(figures)
        if isinstance(value, dict):
            yield from ((figure.metric, count, (label,)) for label, count in value.items())
        elif value is not None:
            yield figure.metric, value, (figure.label_of(figures),) if figure.label_of else ()


class MetricsServer:
    """An endpoint serve_metrics opened: `addr`, `port` (the one bound, for a port of 0), `close()`."""

    def __init__(self, server: http_server.Server, addr: str):
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


def serve_metrics(port: int, addr: str = endpoint.DEFAULT_ADDR) -> MetricsServer:
    """Serves gpumem's metrics at http://addr:port/metrics from a daemon thread, and returns the server.

    `port` is in 0..65535 (0: any free port; read the returned server's .port). `addr` 127.0.0.1 keeps
    the endpoint on the machine; "0.0.0.0" opens it to the network. One thread serves every client,
    each with 10 seconds in all (gpumem.monitoring.http_server, Note [stalled clients]). Starts no CUDA. Raises
    MetricsUnavailable (an ImportError) without prometheus_client, TypeError or ValueError for a bad
    port or address, and OSError naming the address when it cannot be bound (a port in use).
    """
    port, addr = endpoint.checked_port(port), endpoint.checked_addr(addr)
    client = _prometheus()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(Collector())

    def answer(path: str) -> tuple[int, str, bytes]:
        if path not in ("/metrics", "/"):
            return 404, "text/plain; charset=utf-8", b"gpumem serves its metrics at /metrics\n"
        return 200, _TEXT_FORMAT, client.generate_latest(registry)

    try:
        server = http_server.Server(addr, port, answer, name="gpumem-metrics")
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
