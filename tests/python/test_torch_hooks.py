"""What installing gpumem changes in torch's Python API (gpumem/_torch_hooks.py), over fake devices:
torch.cuda.mem_get_info's capped view, and torch's allocator settings changed at run time."""
import subprocess
import sys

import pytest
import torch

import gpumem
from fake_c import GiB
from gpumem import _torch_hooks

MiB = 1 << 20


@pytest.fixture
def devices(fake_c, monkeypatch):
    """The fake devices, with torch's own mem_get_info reporting each fake device's figures and
    torch's settings parser recording what it is given."""
    def device_figures(device=None):
        return fake_c.mem_info(device)

    monkeypatch.setattr(torch.cuda.memory, "mem_get_info", device_figures)
    monkeypatch.setattr(torch.cuda, "mem_get_info", device_figures)
    parsed = []
    for name in _torch_hooks.SETTINGS_SETTERS:  # the one the running torch's _set_allocator_settings calls among them
        monkeypatch.setattr(torch._C, name, parsed.append, raising=False)
    fake_c.parsed = parsed
    return fake_c


def test_under_a_cap_mem_get_info_reports_the_limit_and_what_could_still_be_reserved(devices):
    gpumem.set_limit("2GB")
    devices.malloc(1, 300 * MiB)
    assert torch.cuda.mem_get_info(1) == (2 * GiB - 300 * MiB, 2 * GiB)
    assert torch.cuda.memory.mem_get_info(0) == (2 * GiB, 2 * GiB)


def test_device_mem_info_reports_the_device_itself(devices):
    gpumem.set_limit("2GB")
    devices.malloc(1, 300 * MiB)
    assert gpumem.device_mem_info(1) == (8 * GiB - 300 * MiB, 8 * GiB)


def test_without_a_cap_mem_get_info_is_the_devices_own(devices):
    gpumem.enable()
    devices.malloc(0, 100 * MiB)
    assert torch.cuda.mem_get_info(0) == (8 * GiB - 100 * MiB, 8 * GiB)


def test_the_device_view_turns_the_capped_view_off(devices):
    gpumem.set_limit("2GB")
    gpumem.set_mem_info_view("device")
    assert torch.cuda.mem_get_info(0) == (8 * GiB, 8 * GiB)
    gpumem.set_mem_info_view(" Capped ")
    assert torch.cuda.mem_get_info(0) == (2 * GiB, 2 * GiB)


def test_gpumem_mem_info_device_turns_it_off_from_the_environment(devices, monkeypatch):
    monkeypatch.setenv("GPUMEM_MEM_INFO", "device")
    gpumem.set_limit("2GB")
    assert torch.cuda.mem_get_info(0) == (8 * GiB, 8 * GiB)


@pytest.mark.parametrize("view, error", [("free", ValueError), ("", ValueError), (None, TypeError), (1, TypeError)])
def test_a_bad_view_is_refused_naming_it_and_the_forms(devices, view, error):
    gpumem.set_limit("2GB")
    with pytest.raises(error) as caught:
        gpumem.set_mem_info_view(view)
    assert repr(view) in str(caught.value) and '"capped" or "device"' in str(caught.value)
    assert torch.cuda.mem_get_info(0) == (2 * GiB, 2 * GiB)  # unchanged


def test_a_bad_gpumem_mem_info_stops_the_hook_with_status_2(hook_devices, stopped, monkeypatch):
    hook_devices("4GB")
    monkeypatch.setenv("GPUMEM_MEM_INFO", "sometimes")
    assert stopped().startswith('gpumem: bad GPUMEM_MEM_INFO "sometimes": give "capped" or "device".')


def test_torch_settings_changed_at_run_time_reach_gpumem_after_torch_parsed_them(devices):
    gpumem.enable()
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    assert devices.parsed == ["expandable_segments:False"]
    assert devices.settings_changes == [("expandable_segments:False", False, False)]


def test_gpumem_own_settings_are_kept_from_torch_settings_changed_later(devices, monkeypatch):
    gpumem.set_segments("growable")
    gpumem.set_release_threshold(0.5)
    torch._C._accelerator_setAllocatorSettings("expandable_segments:False,garbage_collection_threshold:0.9")
    assert devices.settings_changes == [("expandable_segments:False,garbage_collection_threshold:0.9", True, True)]


def test_gpumem_segments_keeps_the_segments_from_torch_settings(devices, monkeypatch):
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    gpumem.enable()
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    assert devices.settings_changes == [("expandable_segments:True", True, False)]


def test_a_settings_error_is_torchs_and_gpumem_hears_nothing(devices, monkeypatch):
    def refuse(text):
        raise RuntimeError("Unrecognized key 'nonsense' in CUDA allocator config.")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse)
    gpumem.enable()
    with pytest.raises(RuntimeError, match="Unrecognized key"):
        torch._C._accelerator_setAllocatorSettings("nonsense:1")
    assert devices.settings_changes == []


def test_mem_get_info_keeps_its_name_and_signature_for_code_that_inspects_it(devices):
    import inspect

    gpumem.enable()
    assert list(inspect.signature(torch.cuda.mem_get_info).parameters) == ["device"]
    assert torch.cuda.mem_get_info is torch.cuda.memory.mem_get_info
