"""tools/check_layers.py, the rule that keeps csrc/'s layers apart (docs/design.md): it passes on the
tree as it is, and fails, naming the file and the header, on each kind of breach."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check_layers.py"


def check(root: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True, timeout=60)


@pytest.fixture
def tree(tmp_path):
    """A copy of csrc/ and CMakeLists.txt to break."""
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    shutil.copy(ROOT / "CMakeLists.txt", tmp_path / "CMakeLists.txt")
    return tmp_path


def add_include(path: pathlib.Path, header: str):
    path.write_text(path.read_text() + f'\n#include "{header}"\n')


def test_the_tree_keeps_its_layers():
    result = check(ROOT)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("file, header", [
    ("core/cap.h", "torch/allocator.h"),
    ("core/device_core.cpp", "backends/sim_backend.h"),
    ("core/stats.cpp", "sharing/member.h"),
    ("python/module.cpp", "core/device_core.h"),
    ("python/module.cpp", "backends/sim_backend.cpp"),
    ("torch/allocator.cpp", "sharing/member.h"),
])
def test_a_layer_including_what_it_must_not_fails_naming_both(tree, file, header):
    add_include(tree / "csrc" / file, header)
    result = check(tree)
    assert result.returncode == 1
    assert f"csrc/{file} includes {header}" in result.stdout


def test_a_backend_built_into_the_core_library_fails(tree):
    cmake = tree / "CMakeLists.txt"
    cmake.write_text(cmake.read_text().replace("  csrc/core/pressure.cpp\n", "  csrc/core/pressure.cpp\n  csrc/backends/sim_backend.cpp\n"))
    result = check(tree)
    assert result.returncode == 1
    assert "gpumem_core builds csrc/backends/sim_backend.cpp" in result.stdout


def test_a_core_source_missing_from_the_core_library_fails(tree):
    (tree / "csrc" / "core" / "extra.cpp").write_text("// a new part\n")
    result = check(tree)
    assert result.returncode == 1
    assert "gpumem_core misses csrc/core/extra.cpp" in result.stdout
