"""The torch a build is for: the wheel's version says it, and importing under another torch fails
clearly instead of loading the compiled module (see python/gpumem/_build_check.py)."""
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from packaging.version import Version

import gpumem
from gpumem import _build_check

SETUP_PY = pathlib.Path(__file__).resolve().parents[2] / "setup.py"
OTHER_CUDA = "12.8" if torch.version.cuda != "12.8" else "13.0"


def load_setup():
    spec = importlib.util.spec_from_file_location("gpumem_setup", SETUP_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(torch_version=None, torch_cuda="same"):
    """A build record as setup.py writes it, by default for the torch at hand."""
    return types.SimpleNamespace(
        VERSION="0.1.0+torch0.test",
        TORCH_VERSION=str(torch.__version__) if torch_version is None else torch_version,
        TORCH_CUDA=torch.version.cuda if torch_cuda == "same" else torch_cuda,
    )


def import_gpumem_after(patch, build_record=True):
    """Imports gpumem in a fresh interpreter after running `patch` (torch imported), with a build
    record for the real torch in place if build_record, so the test does not depend on whether
    gpumem here was installed (record written) or runs from the source tree (none)."""
    given = "" if not build_record else textwrap.dedent(f"""
        import sys, types
        record = types.ModuleType("gpumem._build")
        record.VERSION = "0.1.0+torch0.test"
        record.TORCH_VERSION = {str(torch.__version__)!r}
        record.TORCH_CUDA = {torch.version.cuda!r}
        sys.modules["gpumem._build"] = record
        """)
    code = "import torch\n" + given + textwrap.dedent(patch) + "\nimport gpumem\nprint('imported')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


# ---- the version ---------------------------------------------------------------------------------


@pytest.mark.parametrize("torch_version, cuda, tag", [
    ("2.11.0+cu130", "13.0", "torch2.11.0.cu130"),
    ("2.11.0+cpu", None, "torch2.11.0.cpu"),
    ("2.9.1", "12.8", "torch2.9.1.cu128"),
    ("2.12.0.dev20260105+cu130", "13.0", "torch2.12.0.dev20260105.cu130"),
    ("2.11.0a0+gitabc1234", "13.0", "torch2.11.0a0.cu130"),
])
def test_the_local_version_names_the_torch_release_and_its_cuda_build(torch_version, cuda, tag):
    assert load_setup().torch_tag(torch_version, cuda) == tag


def test_the_version_with_its_local_label_is_a_valid_version():
    setup = load_setup()
    version = Version(f"{setup.VERSION}+{setup.torch_tag('2.12.0.dev20260105+cu130', '13.0')}")
    assert version.public == setup.VERSION
    assert version.local == "torch2.12.0.dev20260105.cu130"


def test_the_build_record_setup_writes_reads_back_as_written():
    namespace = {}
    exec(load_setup().build_record("0.1.0+torch2.11.0.cu130", "2.11.0+cu130", "13.0"), namespace)
    assert (namespace["VERSION"], namespace["TORCH_VERSION"], namespace["TORCH_CUDA"]) == \
        ("0.1.0+torch2.11.0.cu130", "2.11.0+cu130", "13.0")


def test_an_installed_gpumem_records_the_torch_at_hand():
    _build = _build_check._build_record()
    if _build is None:
        pytest.skip("gpumem runs from a source tree: no build record")
    assert (_build.TORCH_VERSION, _build.TORCH_CUDA) == (str(torch.__version__), torch.version.cuda)


# ---- what the check compares ------------------------------------------------------------------


def test_the_same_torch_passes():
    assert _build_check.mismatch(record(), str(torch.__version__), torch.version.cuda) is None


def test_another_local_label_of_the_same_release_and_cuda_build_passes():
    assert _build_check.mismatch(record("2.11.0+cu130", "13.0"), "2.11.0", "13.0") is None


@pytest.mark.parametrize("built, running", [
    ("2.11.0+cu130", "2.11.1+cu130"),   # a patch release
    ("2.11.0+cu130", "2.10.0+cu130"),
    ("2.12.0.dev20260105+cu130", "2.12.0.dev20260106+cu130"),  # nightlies, a day apart
    ("2.11.0rc1+cu130", "2.11.0+cu130"),
])
def test_another_torch_release_fails(built, running):
    assert _build_check.mismatch(record(built, "13.0"), running, "13.0") is not None


@pytest.mark.parametrize("built, running", [("13.0", "12.8"), ("13.0", None), (None, "13.0")])
def test_another_cuda_build_of_the_same_release_fails(built, running):
    assert _build_check.mismatch(record("2.11.0", built), "2.11.0", running) is not None


def test_the_message_names_both_torches_and_how_to_rebuild():
    message = _build_check.mismatch(record("2.11.0+cu130", "13.0"), "2.9.0+cpu", None)
    assert "built against torch 2.11.0+cu130 (CUDA 13.0)" in message
    assert "this is torch 2.9.0+cpu (CPU only)" in message
    assert "pip install --no-build-isolation --force-reinstall" in message


# ---- importing ---------------------------------------------------------------------------------


def test_importing_under_the_torch_it_was_built_against_works():
    completed = import_gpumem_after("")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "imported"


def test_importing_under_another_torch_release_fails_before_loading_the_compiled_module():
    completed = import_gpumem_after("torch.__version__ = '2.9.0'")
    assert completed.returncode != 0
    assert "ImportError" in completed.stderr
    assert f"built against torch {torch.__version__}" in completed.stderr
    assert "this is torch 2.9.0" in completed.stderr
    assert "pip install --no-build-isolation --force-reinstall" in completed.stderr
    assert "undefined symbol" not in completed.stderr
    assert "gpumem._C" not in completed.stderr


def test_importing_under_another_cuda_build_fails():
    completed = import_gpumem_after(f"torch.version.cuda = {OTHER_CUDA!r}")
    assert completed.returncode != 0
    assert f"CUDA {OTHER_CUDA}" in completed.stderr and f"CUDA {torch.version.cuda}" in completed.stderr


def test_without_a_build_record_nothing_is_checked(tmp_path):
    package = tmp_path / "gpumem"
    # The package with its subpackages and compiled module, without the record.
    shutil.copytree(pathlib.Path(gpumem.__file__).parent, package,
                    ignore=shutil.ignore_patterns("_build.py", "__pycache__"))
    completed = subprocess.run(
        [sys.executable, "-c", "import torch; torch.__version__ = '2.9.0'; import gpumem; print(gpumem.__file__)"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == str(package / "__init__.py")
