"""Monitoring on a GPU: GPUMEM_METRICS_PORT in a job that never imports gpumem, and on_pressure.

Each test runs in a fresh process (see run_python).
"""
import socket

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("prometheus_client")  # gpumem's optional dependency for metrics

MiB = 1 << 20

SCRAPE = """
import os, urllib.request
from prometheus_client.parser import text_string_to_metric_families

def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("device") == "0" and s.labels.get("case", "over_limit") == "over_limit"}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gpumem_metrics_port_serves_a_job_once_it_starts_cuda(run_python):
    port = free_port()
    result = run_python(
        SCRAPE,
        f"""
        try:
            scrape({port})
            before = "served"
        except OSError:
            before = "closed"
        x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        samples = scrape({port})
        print(json.dumps({{"before": before, "samples": samples, "reserved": torch.cuda.memory_reserved(),
                          "pid": os.getpid()}}))
        """,
        env={"GPUMEM_LIMIT": "512MB", "GPUMEM_METRICS_PORT": str(port), "LOCAL_RANK": "0"},
    )
    samples = result["samples"]
    assert result["before"] == "closed"
    assert samples["gpumem_reserved_bytes"] == result["reserved"]
    assert samples["gpumem_limit_bytes"] == 512 * MiB
    assert samples["gpumem_allocated_bytes"] == 256 * MiB
    assert samples["gpumem_ooms_total"] == 1
    assert samples["gpumem_outside_bytes"] >= 0


def test_on_pressure_calls_back_when_a_job_nears_its_cap(run_python):
    result = run_python(
        """
        import threading
        gpumem.set_limit("1GB")
        called = threading.Event()
        calls = []
        gpumem.on_pressure(0.5, lambda *args: (calls.append(args), called.set()))
        x = torch.empty(600 << 20, dtype=torch.uint8, device="cuda")
        print(json.dumps({"called": called.wait(60), "calls": calls, "reserved": torch.cuda.memory_reserved()}))
        """
    )
    assert result["called"] is True
    [[device, reserved, limit]] = result["calls"]
    assert (device, limit) == (0, 1 << 30)
    assert reserved == result["reserved"]
