"""tools/gpu_check.sh and tools/conformance.sh without a GPU: a conformance suite that cannot be
built is one line and exit status 3 ("incomplete"), never a failure, and the other results stand.
gpu_check.sh runs here over stand-ins for python3 and nvidia-smi, so nothing is built or installed."""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def run(script: str, tmp_path: pathlib.Path, path: str | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = {name: value for name, value in os.environ.items() if name != "CATCH2_INCLUDE"}
    environ.update(OUT=str(tmp_path / "logs"), **env)
    if path is not None:
        environ["PATH"] = path
    return subprocess.run([BASH, str(ROOT / "tools" / script)], env=environ, capture_output=True, text=True,
                          timeout=120)


def empty_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    empty = tmp_path / "empty"
    empty.mkdir()
    return empty


def stand_ins(tmp_path: pathlib.Path, pytest_status: int = 0) -> str:
    """A PATH whose python3 passes every pip run, ends every pytest run with `pytest_status` and
    does nothing else, and whose nvidia-smi prints a line; then PATH as it is."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pytest" ] && exit {pytest_status}\nexit 0\n')
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'a GPU'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_conformance_without_catch2_is_not_built_with_one_line_and_status_3(tmp_path):
    empty = empty_dir(tmp_path)
    completed = run("conformance.sh", tmp_path, CATCH2_INCLUDE=str(empty))
    assert completed.returncode == 3
    assert completed.stdout.splitlines() == [
        f"conformance suite NOT BUILT: no catch2/catch.hpp (Catch2 v2) in {empty}; install Debian's catch2 "
        "(tools/setup.sh) or set CATCH2_INCLUDE to the directory holding catch2/catch.hpp"]


def test_conformance_without_cmake_is_not_built(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    completed = run("conformance.sh", tmp_path, path=str(bin_dir))
    assert completed.returncode == 3
    assert completed.stdout.strip() == "conformance suite NOT BUILT: no cmake on PATH (tools/setup.sh installs it)"


def test_gpu_check_is_incomplete_not_failed_when_only_the_conformance_suite_could_not_be_built(tmp_path):
    completed = run("gpu_check.sh", tmp_path, path=stand_ins(tmp_path), PART="1", DEMO="0",
                    CATCH2_INCLUDE=str(empty_dir(tmp_path)))
    assert completed.returncode == 3, completed.stdout + completed.stderr
    assert completed.stdout.splitlines()[-1].startswith(
        "gpu_check: INCOMPLETE (exit 3): everything run passed, but the conformance suite NOT BUILT: no catch2")
    assert (tmp_path / "logs" / "pytest.log").exists()
    assert "NOT BUILT" in (tmp_path / "logs" / "conformance.log").read_text()


def test_gpu_check_fails_when_a_test_fails_whatever_the_conformance_suite_did(tmp_path):
    # 3 is also pytest's status for an internal error: gpu_check's 3 must mean incomplete only.
    completed = run("gpu_check.sh", tmp_path, path=stand_ins(tmp_path, pytest_status=3), PART="1", DEMO="0",
                    CATCH2_INCLUDE=str(empty_dir(tmp_path)))
    assert completed.returncode == 1
    assert completed.stdout.splitlines()[-1].startswith("gpu_check: FAILED")


def test_gpu_check_passes_when_everything_run_passed(tmp_path):
    completed = run("gpu_check.sh", tmp_path, path=stand_ins(tmp_path), PART="2", DEMO="0", CAPTURE="0")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.splitlines()[-1] == "gpu_check: passed"
