"""Importing gpumem: no side effects on CUDA, and a clear message when it was not built."""
import os
import pathlib
import shutil
import subprocess
import sys

import gpumem


def run(code, **kwargs):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, **kwargs)


def test_import_does_not_initialize_cuda():
    completed = run("import gpumem, torch; print(torch.cuda.is_initialized())")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "False"


def test_import_without_the_compiled_module_says_how_to_build_it(tmp_path):
    package = tmp_path / "gpumem"
    package.mkdir()
    for source in pathlib.Path(gpumem.__file__).parent.glob("*.py"):
        shutil.copy(source, package)
    completed = run("import gpumem", cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert completed.returncode != 0
    assert "gpumem._C could not be imported" in completed.stderr
    assert "pip install --no-build-isolation ." in completed.stderr


def test_the_public_api_is_exported():
    for name in ("set_limit", "get_limit", "enable", "is_enabled", "empty_cache", "stats",
                 "reset_peak_stats", "set_release_threshold"):
        assert callable(getattr(gpumem, name)), name
