"""Which CUDA runtime headers the build compiles against (setup.py's cuda_include_dirs): those of
the runtime torch loads, never headers of another CUDA major version, which compile but call that
runtime wrongly or leave the module unloadable."""
import importlib.util
import pathlib

import pytest
import torch

SETUP_PY = pathlib.Path(__file__).resolve().parents[2] / "setup.py"


@pytest.fixture
def setup_module():
    spec = importlib.util.spec_from_file_location("gpumem_setup_headers", SETUP_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def headers(directory, cudart_version, crt=True):
    directory.mkdir(parents=True)
    (directory / "cuda_runtime_api.h").write_text(
        f'#pragma once\n#include "crt/host_defines.h"\n#define CUDART_VERSION {cudart_version}\n')
    if crt:
        (directory / "crt").mkdir()
        (directory / "crt" / "host_defines.h").write_text("#pragma once\n")
    return directory


def arrange(monkeypatch, setup_module, tmp_path, torch_cuda, wheel_version, toolkit_version, wheel_crt=True):
    """A wheel's runtime beside torch (lib/ and, unless wheel_version is None, include/) and a
    toolkit at CUDA_HOME (unless toolkit_version is None)."""
    wheel = tmp_path / "site-packages" / "nvidia" / "cuda_runtime"
    (wheel / "lib").mkdir(parents=True)
    if wheel_version is not None:
        headers(wheel / "include", wheel_version, wheel_crt)
    toolkit = tmp_path / "cuda"
    if toolkit_version is not None:
        headers(toolkit / "include", toolkit_version)
    monkeypatch.setattr(setup_module, "cudart_library", lambda: (str(wheel / "lib"), ":libcudart.so.12"))
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    return str(wheel / "include"), str(toolkit / "include")


def test_the_headers_beside_torchs_runtime_come_first(monkeypatch, setup_module, tmp_path):
    wheel, toolkit = arrange(monkeypatch, setup_module, tmp_path, "12.4", 12040, 12040)
    assert setup_module.cuda_include_dirs() == [wheel, toolkit]


def test_a_toolkit_of_another_major_version_only_fills_in_behind_the_wheels_headers(monkeypatch, setup_module, tmp_path):
    wheel, toolkit = arrange(monkeypatch, setup_module, tmp_path, "12.4", 12040, 13000, wheel_crt=False)
    assert setup_module.cuda_include_dirs() == [wheel, toolkit]


def test_the_toolkit_serves_where_the_runtime_brought_no_headers(monkeypatch, setup_module, tmp_path):
    _, toolkit = arrange(monkeypatch, setup_module, tmp_path, "13.0", None, 13000)
    assert setup_module.cuda_include_dirs() == [toolkit]


def test_headers_a_wheel_includes_but_nobody_has_stop_the_build_naming_them(monkeypatch, setup_module, tmp_path):
    wheel, _ = arrange(monkeypatch, setup_module, tmp_path, "13.0", 13000, None, wheel_crt=False)
    with pytest.raises(SystemExit, match=r"include crt/host_defines\.h"):
        setup_module.cuda_include_dirs()


def test_headers_of_another_major_version_only_stop_the_build_with_both_named(monkeypatch, setup_module, tmp_path):
    _, toolkit = arrange(monkeypatch, setup_module, tmp_path, "12.4", None, 13000)
    with pytest.raises(SystemExit, match=r"CUDA 12\.4's runtime.*" + toolkit.replace(".", r"\.") + ".*CUDA 12 toolkit"):
        setup_module.cuda_include_dirs()


def test_no_headers_at_all_stop_the_build_naming_where_it_looked(monkeypatch, setup_module, tmp_path):
    arrange(monkeypatch, setup_module, tmp_path, "13.0", None, None)
    with pytest.raises(SystemExit, match=r"no CUDA runtime headers.*" + str(tmp_path / "cuda").replace(".", r"\.")):
        setup_module.cuda_include_dirs()


def test_the_installed_torch_gets_headers_of_its_own_cuda_major():
    spec = importlib.util.spec_from_file_location("gpumem_setup_installed", SETUP_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if torch.version.cuda is None:
        pytest.skip("a CPU build of torch names no CUDA runtime")
    text = (pathlib.Path(module.cuda_include_dirs()[0]) / "cuda_runtime_api.h").read_text()
    version = int(text.split("#define CUDART_VERSION", 1)[1].split()[0])
    assert version // 1000 == int(torch.version.cuda.split(".")[0])
