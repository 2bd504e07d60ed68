from __future__ import annotations

import fcntl
import importlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from fake_c import GiB, FakeC, use_fake_c
from gpumem.settings import environment


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "known_limitation: checks the clear error gpumem gives for something it does not support"
    )
    config.addinivalue_line(
        "markers", "whole_gpu: fills the GPU, so runs while no other test of a test_gpu_ file runs (pytest -n)"
    )


# Tests run side by side (pytest-xdist) share the GPU. A whole_gpu test fills it, so it holds
# GPU_LOCK exclusively, and every other test of a test_gpu_ file holds it shared, over the test's
# whole run: setup (module fixtures that start GPU processes too), call and teardown. flock favours
# no one, so a whole_gpu test first takes GPU_GATE, which every shared taker passes through
# briefly: once it waits there, no new test starts, and it has the GPU when those running end.
GPU_LOCK = os.path.join("/tmp", f"gpumem-tests-gpu-{os.getuid()}.lock")
GPU_GATE = GPU_LOCK + ".gate"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    whole = item.get_closest_marker("whole_gpu") is not None
    if not whole and not item.module.__name__.startswith("test_gpu_"):
        yield
        return
    with open(GPU_GATE, "a") as gate, open(GPU_LOCK, "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if whole else fcntl.LOCK_SH)
        finally:
            if not whole:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.fixture
def fake_c(monkeypatch):
    """gpumem's Python layer over two fake 8 GiB devices that map pages, CUDA not yet initialized,
    GPUMEM_LIMIT and GPUMEM_SEGMENTS unset."""
    fake = FakeC([8 * GiB, 8 * GiB])
    use_fake_c(monkeypatch, fake)
    return fake


@pytest.fixture
def hook_devices(monkeypatch):
    """The autoload hook about to run over fake 8 GiB devices: make(limit, segments=None, count=2)
    sets GPUMEM_LIMIT (which arms the hook) and GPUMEM_SEGMENTS, and returns the fake _C."""
    from gpumem import _autoload

    monkeypatch.setattr(_autoload, "state", "not run")
    monkeypatch.setattr(sys, "argv", ["train.py"])

    def make(limit: str, segments: str | None = None, count: int = 2) -> FakeC:
        fake = FakeC([8 * GiB] * count)
        use_fake_c(monkeypatch, fake)
        monkeypatch.setenv("GPUMEM_LIMIT", limit)
        if segments is not None:
            monkeypatch.setenv("GPUMEM_SEGMENTS", segments)
        return fake

    return make


@pytest.fixture
def stopped(capsys):
    """Runs the autoload hook, which must stop the program with status 2; returns its one line."""
    from gpumem import _autoload

    def run() -> str:
        with pytest.raises(SystemExit) as caught:
            _autoload.install()
        assert caught.value.code == 2
        [line] = capsys.readouterr().err.splitlines()
        return line

    return run


@pytest.fixture(scope="session")  # holds no state: module fixtures may share one process's result
def run_python():
    """Runs Python code in a fresh interpreter and returns the JSON value it prints last.

    gpumem swaps the allocator once per process, before CUDA starts, so every GPU test needs a
    process of its own. The code (parts, each dedented, joined by lines) starts with json, torch
    and gpumem imported.
    """

    def run(*parts: str, env: dict | None = None, timeout: float = 300):
        script = "\n".join(["import json, torch, gpumem"] + [textwrap.dedent(part) for part in parts])
        completed = subprocess.run(
            [sys.executable, "-c", script],
            env={**environment_without_gpumem_settings(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if completed.returncode != 0:
            pytest.fail(f"snippet exited with {completed.returncode}:\n{completed.stderr[-6000:]}")
        lines = completed.stdout.strip().splitlines()
        if not lines:
            pytest.fail(f"snippet printed nothing:\n{completed.stderr[-6000:]}")
        return json.loads(lines[-1])

    return run


def environment_without_gpumem_settings() -> dict:
    """The environment less GPUMEM_LIMIT and every other gpumem setting: one in the caller's shell
    must not change what a test sets up."""
    settings = {"GPUMEM_LIMIT", *(name for name, _ in environment.SETTINGS)}
    return {name: value for name, value in os.environ.items() if name not in settings}


BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """A benchmark script as a module: the benchmarks are scripts beside common.py, not a package."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
