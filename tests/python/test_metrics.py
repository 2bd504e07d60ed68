"""Prometheus metrics (gpumem.metrics): a real endpoint on loopback, scraped over HTTP and parsed as
Prometheus parses it, over the fake compiled layer (simulated devices) or a simulated device alone."""
from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

import gpumem
from gpumem import _C
from gpumem.monitoring import http_server, metrics, startup
from gpumem.settings import environment

MiB, GiB = 1 << 20, 1 << 30


def scrape(port: int) -> dict[str, list]:
    """Metric family name -> its samples, as Prometheus would read http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(families: dict, sample: str, **labels) -> float:
    family = sample.removesuffix("_total")
    found = [s.value for s in families[family]
             if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{sample} {labels}: {found}"
    return found[0]


@pytest.fixture
def served(fake_c, monkeypatch):
    """gpumem.serve_metrics on a free loopback port over the fake devices, job "train.py"."""
    monkeypatch.setattr(sys, "argv", ["/jobs/train.py", "--epochs", "3"])
    monkeypatch.delenv("GPUMEM_JOB", raising=False)
    server = gpumem.serve_metrics(0)
    yield server
    server.close()


@pytest.fixture
def serve_source():
    """serve(source) -> the port of an endpoint whose Collector reads `source`."""
    servers = []

    def serve(source) -> int:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(metrics.Collector(source, job="test"))
        server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        servers.append((server, thread))
        return server.server_port

    yield serve
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- what is reported ---------------------------------------------------------------------------


def test_a_device_in_use_reports_its_bytes_and_limit(fake_c, served):
    fake_c.set_limit_bytes(1, 2 * GiB)
    block = fake_c.malloc(1, 100 * MiB)
    fake_c.sims[1].free(block)
    fake_c.malloc(1, 40 * MiB)
    families = scrape(served.port)
    labels = {"device": "1", "pid": str(os.getpid()), "job": "train.py"}
    reserved = fake_c.sims[1].reserved(0)
    assert value(families, "gpumem_reserved_bytes", **labels) == reserved
    assert value(families, "gpumem_limit_bytes", **labels) == 2 * GiB
    assert value(families, "gpumem_allocated_bytes", **labels) == 40 * MiB
    assert value(families, "gpumem_allocated_peak_bytes", **labels) == 100 * MiB
    assert value(families, "gpumem_reserved_peak_bytes", **labels) == fake_c.stats(1)["reserved_bytes.all.peak"]
    assert value(families, "gpumem_free_under_limit_bytes", **labels) == 2 * GiB - reserved


def test_a_device_not_used_yet_reports_nothing(fake_c, served):
    fake_c.malloc(0, 1 * MiB)
    families = scrape(served.port)
    assert {s.labels["device"] for s in families["gpumem_reserved_bytes"]} == {"0"}
    assert fake_c.sims[1].existing_devices() == []


def test_scraping_makes_no_device(serve_source):
    sim = _C.SimAllocator(1 * GiB, 2)
    families = scrape(serve_source(sim))
    assert families["gpumem_reserved_bytes"] == []
    assert sim.existing_devices() == []


def test_out_of_memory_errors_are_counted_by_case(fake_c, served):
    fake_c.set_limit_bytes(0, 100 * MiB)
    with pytest.raises(MemoryError):
        fake_c.malloc(0, 200 * MiB)  # over the limit
    fake_c.sims[0].fail_next(10)
    with pytest.raises(MemoryError):
        fake_c.malloc(0, 10 * MiB)  # the device refuses
    families = scrape(served.port)
    assert value(families, "gpumem_ooms_total", device="0", case="over_limit") == 1
    assert value(families, "gpumem_ooms_total", device="0", case="device_full") == 1
    assert value(families, "gpumem_ooms_total", device="0", case="fragmentation") == 0


def test_retries_and_cache_releases_are_counted(fake_c, served):
    fake_c.set_limit_bytes(0, 100 * MiB)
    fake_c.set_growable(0, False)
    sim = fake_c.sims[0]
    sim.free(sim.malloc(0, 60 * MiB, 0))
    sim.malloc(0, 60 * MiB, 1)  # another stream: the cached segment must go first
    families = scrape(served.port)
    assert value(families, "gpumem_alloc_retries_total", device="0") == 1
    assert value(families, "gpumem_cache_releases_total", device="0") == 1


def test_pressure_crossings_are_counted_by_share(fake_c, served):
    fake_c.watch_pressure(0.5)
    fake_c.set_limit_bytes(0, 100 * MiB)
    fake_c.malloc(0, 60 * MiB)
    families = scrape(served.port)
    assert value(families, "gpumem_pressure_crossings_total", device="0", share="0.5") == 1


class FixedSource:
    """One device in use, with figures a test chooses."""

    def __init__(self, reserved: int, limit: int, device_free, device_total):
        stats = {key: 0 for key in _C.SimAllocator(GiB).stats(0)}
        self.figures = {"reserved": reserved, "counted": reserved, "counted_peak": reserved, "limit": limit,
                        "stats": stats, "device_free": device_free,
                        "device_total": device_total, "scope": "allocator", "outside": 0, "outside_source": "none"}

    def existing_devices(self):
        return [0]

    def device_figures(self, device):
        return self.figures

    def pressure_crossings(self):
        return []


def test_memory_outside_gpumem_is_the_device_used_less_reserved(serve_source):
    port = serve_source(FixedSource(reserved=3 * GiB, limit=4 * GiB, device_free=10 * GiB, device_total=16 * GiB))
    assert value(scrape(port), "gpumem_outside_bytes", device="0") == 3 * GiB


def test_memory_outside_gpumem_is_left_out_where_the_device_cannot_say(serve_source):
    port = serve_source(FixedSource(reserved=3 * GiB, limit=4 * GiB, device_free=None, device_total=None))
    families = scrape(port)
    assert families["gpumem_outside_bytes"] == []
    assert value(families, "gpumem_reserved_bytes", device="0") == 3 * GiB


def test_the_bytes_paused_regions_gave_back_are_a_gauge(serve_source):
    sim = _C.SimAllocator(GiB, page_size=2 * MiB)
    sim.region_create(0, 1)
    sim.region_begin(0, 1)
    sim.malloc(0, 100 * MiB)
    sim.region_end(0, 1)
    port = serve_source(sim)
    assert value(scrape(port), "gpumem_paused_bytes", device="0") == 0
    paused = sim.region_pause(0, 1, False)
    families = scrape(port)
    assert value(families, "gpumem_paused_bytes", device="0") == paused >= 100 * MiB
    assert value(families, "gpumem_reserved_bytes", device="0") == 0


def test_free_under_a_lowered_limit_is_zero_not_negative(serve_source):
    port = serve_source(FixedSource(reserved=5 * GiB, limit=4 * GiB, device_free=None, device_total=None))
    assert value(scrape(port), "gpumem_free_under_limit_bytes", device="0") == 0


def test_the_counters_are_counters_and_the_figures_gauges(served):
    types = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=30) as response:
        for family in text_string_to_metric_families(response.read().decode()):
            types[family.name] = family.type
    assert types["gpumem_ooms"] == types["gpumem_pressure_crossings"] == "counter"
    assert types["gpumem_reserved_bytes"] == types["gpumem_outside_bytes"] == "gauge"
    assert set(types) == {figure.metric for figure in metrics.METRICS}


# ---- the label job ------------------------------------------------------------------------------


def test_the_job_is_gpumem_job_when_set():
    assert metrics.job_name({"GPUMEM_JOB": "bert-large"}, ["train.py"]) == "bert-large"


@pytest.mark.parametrize("argv, job", [(["/jobs/train.py", "-x"], "train.py"), (["-c"], "python"), ([], "python")])
def test_the_job_is_the_programs_name_otherwise(argv, job):
    assert metrics.job_name({}, argv) == job


def test_a_long_job_name_is_cut():
    assert len(metrics.job_name({"GPUMEM_JOB": "j" * 10_000}, [])) == 128


# ---- serve_metrics ------------------------------------------------------------------------------


def test_a_port_in_use_is_an_os_error_naming_the_address(served):
    expected = rf"^gpumem: cannot serve metrics on 127.0.0.1:{served.port}: .*pick another"
    with pytest.raises(OSError, match=expected) as caught:
        gpumem.serve_metrics(served.port)
    assert caught.value.errno == errno.EADDRINUSE


def test_a_forked_child_lets_go_of_the_port_and_the_parent_still_serves(served):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if served._server.listener.fileno() == -1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "gpumem_limit_bytes" in scrape(served.port)


@pytest.mark.parametrize("port", ["9400", 9400.0, True, None])
def test_a_port_that_is_not_an_int_is_a_type_error(port):
    with pytest.raises(TypeError, match="metrics port .* is not an int; give 0..65535"):
        gpumem.serve_metrics(port)


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_port_out_of_range_is_a_value_error(port):
    with pytest.raises(ValueError, match=f"bad metrics port {port}: give 0..65535"):
        gpumem.serve_metrics(port)


@pytest.mark.parametrize("addr", ["", None, 127001])
def test_an_address_that_is_not_a_name_is_a_type_error(addr):
    with pytest.raises(TypeError, match="metrics address .* is not a host name or IP address"):
        gpumem.serve_metrics(0, addr)


def test_without_prometheus_client_serve_metrics_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pip install prometheus_client") as caught:
        gpumem.serve_metrics(0)
    assert isinstance(caught.value, metrics.MetricsUnavailable)


# ---- GPUMEM_METRICS_PORT ------------------------------------------------------------------------


@pytest.mark.parametrize("text, port", [("9400", 9400), (" 1 ", 1), ("65535", 65535)])
def test_gpumem_metrics_port_reads_a_port(text, port):
    assert environment.metrics_port({"GPUMEM_METRICS_PORT": text}) == port


@pytest.mark.parametrize("text", ["", "0", "65536", "-1", "94OO", "9400.0", "٩٤٠٠", "9" * 100])
def test_a_bad_gpumem_metrics_port_names_the_variable_and_the_accepted_forms(text):
    with pytest.raises(ValueError, match=r"GPUMEM_METRICS_PORT=.* cannot be applied: give a port number in 1..65535"):
        environment.metrics_port({"GPUMEM_METRICS_PORT": text})


def test_each_process_serves_on_the_base_port_plus_its_local_rank(fake_c):
    port = free_port()
    server = startup.serve_metrics_for_environment(port - 3, {"LOCAL_RANK": "3"})
    try:
        assert server.port == port
        assert "gpumem_reserved_bytes" in scrape(port)
    finally:
        server.close()


def test_without_local_rank_the_base_port_is_served(fake_c):
    port = free_port()
    server = startup.serve_metrics_for_environment(port, {})
    try:
        assert server.port == port
    finally:
        server.close()


def test_a_port_in_use_from_the_environment_is_one_line_on_stderr_and_the_program_goes_on(served, capsys):
    assert startup.serve_metrics_for_environment(served.port, {}) is None
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"gpumem: GPUMEM_METRICS_PORT={served.port}: no metrics are served (cannot serve metrics")
    assert line.endswith("; the program goes on without them.")


def test_a_bad_local_rank_is_one_line_on_stderr(fake_c, capsys):
    assert startup.serve_metrics_for_environment(9400, {"LOCAL_RANK": "first"}) is None
    [line] = capsys.readouterr().err.splitlines()
    assert "LOCAL_RANK='first' is not a number of 0 or more" in line


def test_without_prometheus_client_the_environment_gets_one_line_on_stderr(fake_c, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    assert startup.serve_metrics_for_environment(free_port(), {}) is None
    [line] = capsys.readouterr().err.splitlines()
    assert "pip install prometheus_client" in line


def test_a_bad_gpumem_metrics_port_at_autoload_stops_the_program(hook_devices, stopped, monkeypatch):
    hook_devices("4GB")
    monkeypatch.setenv("GPUMEM_METRICS_PORT", "http")
    line = stopped()
    assert line.startswith('gpumem: bad GPUMEM_METRICS_PORT "http": give a port number in 1..65535')


def test_gpumem_metrics_port_at_autoload_serves_once_cuda_starts(hook_devices, monkeypatch):
    from gpumem import _autoload

    queued = []
    monkeypatch.setattr(startup.torch.cuda, "_lazy_call", queued.append)
    hook_devices("4GB")
    port = free_port()
    monkeypatch.setenv("GPUMEM_METRICS_PORT", str(port))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    _autoload.install()
    assert _autoload.state == "installed"
    with pytest.raises(OSError):  # nothing listens before CUDA starts
        scrape(port)
    [start] = queued
    monkeypatch.setattr(startup, "serve_metrics_for_environment", _keeping(startup.serve_metrics_for_environment, servers := []))
    start()
    try:
        assert scrape(port)["gpumem_limit_bytes"] == []  # no device used yet
    finally:
        for server in servers:
            server.close()


def _keeping(serve, servers: list):
    def keep(*args, **kwargs):
        server = serve(*args, **kwargs)
        servers.append(server)
        return server

    return keep


# ---- the endpoint under hostile clients ---------------------------------------------------------


def stalled_client(port: int, sent: bytes = b"GET /metrics HTTP/1.1\r\nHost: gpumem\r\n") -> socket.socket:
    """A loopback client that sends the start of a request and never its end."""
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    client.sendall(sent)
    return client


def answered(client: socket.socket) -> bool:
    """Whether the server has written to (or closed) the client's connection."""
    client.setblocking(False)
    try:
        client.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    finally:
        client.setblocking(True)
    return True


def raw_request(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(request)
        chunks = []
        while chunk := client.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_scrape_is_answered_while_200_clients_stall_and_no_thread_is_added(served, monkeypatch):
    # The stalled clients keep their connections for the whole test, however slowly a loaded
    # machine runs it; a server that waited for them would not answer the scrape within its 30 s.
    monkeypatch.setattr(http_server, "CONNECTION_SECONDS", 600.0)
    threads = threading.active_count()
    stalled = []
    try:
        stalled = [stalled_client(served.port) for _ in range(200)]
        families = scrape(served.port)
        assert "gpumem_limit_bytes" in families
        assert threading.active_count() == threads  # one thread serves them all
        assert not any(answered(client) for client in stalled)  # held, their requests unfinished
    finally:
        for client in stalled:
            client.close()


def test_a_client_that_stalls_is_closed_once_its_time_is_up(fake_c, monkeypatch):
    monkeypatch.setattr(http_server, "CONNECTION_SECONDS", 0.2)
    with gpumem.serve_metrics(0) as server, stalled_client(server.port) as client:
        assert client.recv(1) == b""  # closed by the server (the client's own timeout is 30 s)
        assert "gpumem_limit_bytes" in scrape(server.port)


def test_one_client_past_the_most_at_once_closes_the_oldest(fake_c, monkeypatch):
    monkeypatch.setattr(http_server, "MAX_CONNECTIONS", 4)
    with gpumem.serve_metrics(0) as server:
        clients = [stalled_client(server.port) for _ in range(4)]
        try:
            assert "gpumem_limit_bytes" in scrape(server.port)  # the fifth, which closes the first
            assert clients[0].recv(1) == b""
            assert not any(answered(client) for client in clients[1:])
        finally:
            for client in clients:
                client.close()


def test_the_listener_queues_100_connections_before_it_accepts_one():
    listener = http_server._listen("127.0.0.1", 0)  # bound and listening, never accepting: a burst meets only the backlog
    clients = []
    try:
        for _ in range(100):  # a backlog of 5 let 6 in; the 7th waited for the SYN to be sent again
            clients.append(socket.create_connection(("127.0.0.1", listener.getsockname()[1]), timeout=1))
    finally:
        for client in clients:
            client.close()
        listener.close()
    assert len(clients) == 100


def test_a_request_head_past_8_kib_is_refused_and_closed(served):
    response = raw_request(served.port, b"GET /metrics HTTP/1.1\r\nX: " + b"x" * 9000)
    assert response.startswith(b"HTTP/1.1 431 ")


@pytest.mark.parametrize("request_line, status", [(b"GET /metrics HTTP/1.1", 200), (b"HEAD /metrics HTTP/1.1", 200),
                                                  (b"GET / HTTP/1.0", 200), (b"GET /other HTTP/1.1", 404),
                                                  (b"POST /metrics HTTP/1.1", 405), (b"\xff\xfe", 400)],
                         ids=["get", "head", "root", "other-path", "post", "not-http"])
def test_each_request_gets_its_status(served, request_line, status):
    response = raw_request(served.port, request_line + b"\r\nHost: gpumem\r\n\r\n")
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode())
    assert (body == b"") == request_line.startswith(b"HEAD")


def test_a_job_name_with_bytes_that_are_not_utf_8_is_escaped_and_scrapes_answer(fake_c, monkeypatch, capfd):
    monkeypatch.setenv("GPUMEM_JOB", 'bert\udcff\n"x')  # GPUMEM_JOB=$'bert\xff\n"x'
    fake_c.malloc(0, 2 * MiB)
    with gpumem.serve_metrics(0) as server:
        families = scrape(server.port)
    assert value(families, "gpumem_limit_bytes", job='bert\\udcff\\n"x') == 8 * GiB
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("text, label", [("plain", "plain"), ("a\tb", "a\\tb"), ("\x1b[2J", "\\x1b[2J"),
                                         ("é中", "é中"), ("\ud800", "\\ud800"), ("j" * 500, "j" * 128)])
def test_a_label_value_is_any_string_made_printable_utf_8(text, label):
    assert metrics.label_value(text) == label
    metrics.label_value(text).encode("utf-8")


def test_an_error_while_reading_the_figures_is_http_500_with_nothing_on_stderr(fake_c, served, monkeypatch, capfd):
    fake_c.malloc(0, 2 * MiB)
    monkeypatch.setattr(fake_c, "device_figures", lambda device: 1 / 0)
    with pytest.raises(urllib.error.HTTPError) as caught:
        scrape(served.port)
    assert caught.value.code == 500
    assert capfd.readouterr().err == ""
    monkeypatch.undo()


# ---- GPUMEM_METRICS_ADDR --------------------------------------------------------------------------


@pytest.mark.parametrize("environ, addr", [({}, "127.0.0.1"), ({"GPUMEM_METRICS_ADDR": "0.0.0.0"}, "0.0.0.0"),
                                           ({"GPUMEM_METRICS_ADDR": " ::1 "}, "::1"),
                                           ({"GPUMEM_METRICS_ADDR": "node-7.cluster"}, "node-7.cluster")])
def test_gpumem_metrics_addr_reads_an_address_and_defaults_to_loopback(environ, addr):
    assert environment.metrics_addr(environ) == addr


@pytest.mark.parametrize("text", ["", "http://0.0.0.0", "0.0.0.0:9400", "a b", "-x", "\udcff", "h" * 300])
def test_a_bad_gpumem_metrics_addr_names_the_variable_and_the_accepted_forms(text):
    with pytest.raises(ValueError, match=r"GPUMEM_METRICS_ADDR=.* cannot be applied: .*give an address to listen on"):
        environment.metrics_addr({"GPUMEM_METRICS_ADDR": text})


def test_a_bad_gpumem_metrics_addr_at_autoload_stops_the_program(hook_devices, stopped, monkeypatch):
    hook_devices("4GB")
    monkeypatch.setenv("GPUMEM_METRICS_ADDR", "0.0.0.0:80")
    assert stopped().startswith('gpumem: bad GPUMEM_METRICS_ADDR "0.0.0.0:80": give an address to listen on')


def test_gpumem_metrics_addr_at_autoload_is_where_the_endpoint_listens(hook_devices, monkeypatch):
    from gpumem import _autoload

    queued = []
    monkeypatch.setattr(startup.torch.cuda, "_lazy_call", queued.append)
    hook_devices("4GB")
    port = free_port()
    monkeypatch.setenv("GPUMEM_METRICS_PORT", str(port))
    monkeypatch.setenv("GPUMEM_METRICS_ADDR", "127.0.0.2")  # loopback still, but not the default
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    _autoload.install()
    monkeypatch.setattr(startup, "serve_metrics_for_environment", _keeping(startup.serve_metrics_for_environment, servers := []))
    [start] = queued
    start()
    try:
        [server] = servers
        assert server.addr == "127.0.0.2"
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=30) as response:
            assert response.status == 200
    finally:
        for server in servers:
            server.close()


def test_an_address_this_machine_does_not_have_is_one_line_on_stderr_naming_it(fake_c, capsys):
    assert startup.serve_metrics_for_environment(free_port(), {}, addr="no-such-host.invalid") is None
    [line] = capsys.readouterr().err.splitlines()
    assert "cannot serve metrics on no-such-host.invalid:" in line and "pick another" not in line


def test_closing_the_endpoint_ends_its_thread_and_a_second_close_does_nothing(fake_c):
    threads = threading.active_count()
    server = gpumem.serve_metrics(0)
    assert threading.active_count() == threads + 1
    server.close()
    server.close()
    assert threading.active_count() == threads
    with pytest.raises(OSError):
        scrape(server.port)
