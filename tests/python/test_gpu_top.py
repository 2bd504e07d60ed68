"""`gpumem top` on a GPU, against real processes: one job under gpumem past 85% of its cap, one under
a limit on the whole process, one on PyTorch's own allocator, and one under gpumem that was killed
and left its figures file behind."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gpumem.monitoring import published

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("pynvml")  # nvidia-ml-py, which gpumem top reads the GPUs through

MiB = 1 << 20

# Holds `mib` MiB on the GPU, says so, and waits for its stdin to close.
HOLD = """
import sys, torch
if sys.argv[1] != "native":
    import gpumem
    gpumem.set_limit(sys.argv[2], scope=sys.argv[1])
x = torch.empty(int(sys.argv[3]) << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("holding", flush=True)
sys.stdin.read()
"""


def start(run_dir: str, how: str, limit: str, mib: int, job: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}
    env.update(GPUMEM_RUN_DIR=run_dir, GPUMEM_JOB=job)
    child = subprocess.Popen([sys.executable, "-c", HOLD, how, limit, str(mib)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout.readline() == "holding\n", child.stderr.read()[-4000:]
    return child


def published_by(run_dir: str, pid: int) -> list:
    """The figures files of process `pid` in the run directory, by the names publishing gives them."""
    return [name for name in os.listdir(run_dir)
            if (match := published.NAME.fullmatch(name)) and int(match.group(1)) == pid]


def top_json(run_dir: str) -> dict:
    env = {**os.environ, "GPUMEM_RUN_DIR": run_dir}
    done = subprocess.run([sys.executable, "-m", "gpumem", "top", "--json"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_gpumem_top_shows_real_processes_with_their_figures(tmp_path):
    run_dir = str(tmp_path / "run")
    near = start(run_dir, "allocator", "1GB", 900, "near-cap")
    whole = start(run_dir, "process", "4GB", 1024, "whole")
    native = start(run_dir, "native", "-", 256, "native")
    killed = start(run_dir, "allocator", "2GB", 128, "killed")
    children = [near, whole, native, killed]
    try:
        deadline = time.time() + 30  # each publishes within a second of holding its memory
        while len(os.listdir(run_dir)) < 3 and time.time() < deadline:
            time.sleep(0.2)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert published_by(run_dir, killed.pid)  # left behind
        document = top_json(run_dir)
    finally:
        for child in children:
            if child.poll() is None:
                child.stdin.close()
                child.wait(timeout=60)
    rows = {row["pid"]: row for row in document["processes"]}
    print(json.dumps(document, indent=1)[:6000])

    ours = rows[near.pid]
    assert ours["in_nvml"] and ours["job"] == "near-cap"
    figures = ours["gpumem"]
    assert figures["limit_bytes"] == 1 << 30 and figures["allocated_bytes"] == 900 * MiB
    assert figures["past_warn_at"] is True and figures["scope"] == "allocator"
    # The driver counts the context too: more than gpumem's reserved.
    assert ours["used_bytes"] > figures["reserved_bytes"]

    counted = rows[whole.pid]["gpumem"]
    assert counted["scope"] == "process" and counted["past_warn_at"] is False
    assert counted["process_outside_bytes"] > 0
    assert rows[whole.pid]["used_bytes"] <= 4 << 30

    assert rows[native.pid]["gpumem"] is None and rows[native.pid]["used_bytes"] >= 256 * MiB
    assert killed.pid not in rows
    assert document["stale_removed"] >= 1
    assert not published_by(run_dir, killed.pid)
