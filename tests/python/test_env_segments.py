"""GPUMEM_SEGMENTS, applied when gpumem is installed, over fake devices (fake_c.py); and the autoload
hook, which stops a program whose GPUMEM_SEGMENTS is bad."""
import os
import subprocess
import sys

import pytest

import gpumem
from fake_c import GiB
from gpumem import _autoload
from gpumem.settings import environment

MiB = 1 << 20


@pytest.mark.parametrize("value, growable", [("plain", False), ("growable", True), ("PLAIN", False)])
def test_the_value_is_read_as_a_segment_kind(value, growable):
    assert environment.segments({"GPUMEM_SEGMENTS": value}) is growable


def test_unset_means_the_default():
    assert environment.segments({}) is None


@pytest.mark.parametrize("value", ["", "fast", "expandable", "plain,growable", "0:plain"])
def test_a_bad_value_is_an_error_naming_the_variable_its_value_and_the_forms(value):
    with pytest.raises(ValueError) as caught:
        environment.segments({"GPUMEM_SEGMENTS": value})
    message = str(caught.value)
    assert f"GPUMEM_SEGMENTS={value!r}" in message
    assert '"growable" or "plain"' in message


def test_it_applies_to_every_device_at_enable(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    gpumem.enable()
    assert fake_c.segments() == [False, False]


def test_the_first_set_limit_applies_it(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    gpumem.set_limit("1GB")
    assert fake_c.segments() == [False, False]


def test_an_explicit_set_segments_overrides_it(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    gpumem.set_segments("growable", device=1)
    assert fake_c.segments() == [False, True]


def test_a_second_enable_does_not_apply_it_again(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    gpumem.enable()
    gpumem.set_segments("growable")
    gpumem.enable()
    assert fake_c.segments() == [True, True]


def test_it_applies_with_gpumem_limit(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    monkeypatch.setenv("GPUMEM_LIMIT", "1GB")
    gpumem.enable()
    assert fake_c.segments() == [False, False] and fake_c.limits() == [1 * GiB, 1 * GiB]


def test_a_bad_value_leaves_gpumem_uninstalled_and_the_limits_unset(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_SEGMENTS", "fast")
    monkeypatch.setenv("GPUMEM_LIMIT", "1GB")
    with pytest.raises(ValueError, match="GPUMEM_SEGMENTS='fast'"):
        gpumem.enable()
    assert not fake_c.installed
    assert fake_c.limits() == [8 * GiB, 8 * GiB] and fake_c.segments() == [True, True]


def test_a_bad_value_stops_set_limit_too(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_SEGMENTS", "fast")
    with pytest.raises(ValueError, match="GPUMEM_SEGMENTS"):
        gpumem.set_limit("1GB")
    assert not fake_c.installed and fake_c.limits() == [8 * GiB, 8 * GiB]


# ---- the autoload hook --------------------------------------------------------------------------


@pytest.fixture
def devices(hook_devices):
    """Fake 8 GiB devices, GPUMEM_LIMIT=4GB (which arms the hook) and GPUMEM_SEGMENTS as given."""
    return lambda segments, count=2: hook_devices("4GB", segments, count)


def test_the_hook_applies_it(devices):
    fake = devices("plain")
    _autoload.install()
    assert _autoload.state == "installed"
    assert fake.segments() == [False, False] and fake.limits() == [4 * GiB, 4 * GiB]


def test_a_bad_value_stops_the_hook_with_status_2_naming_it_and_the_forms(devices, stopped):
    fake = devices("fast")
    line = stopped()
    assert line == ('gpumem: bad GPUMEM_SEGMENTS "fast": give "growable" or "plain". The program stops rather '
                    "than run with settings it did not ask for: fix GPUMEM_SEGMENTS or unset it.")
    assert not fake.installed


def test_a_bad_value_stops_the_hook_even_without_a_device(devices, stopped):
    devices("fast", count=0)
    assert stopped().startswith('gpumem: bad GPUMEM_SEGMENTS "fast": ')


def test_a_bad_value_stops_a_torch_program_at_import_with_status_2():
    env = {**os.environ, "GPUMEM_LIMIT": "4GB", "GPUMEM_SEGMENTS": "fast"}
    completed = subprocess.run([sys.executable, "-c", "import torch\nprint('the program ran')"], env=env,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2
    assert "the program ran" not in completed.stdout
    assert 'gpumem: bad GPUMEM_SEGMENTS "fast": give "growable" or "plain".' in completed.stderr
    assert "Traceback" not in completed.stderr


def test_without_gpumem_limit_it_installs_nothing_at_start_up():
    # GPUMEM_SEGMENTS says which segments gpumem uses once installed; it does not install gpumem.
    env = {name: value for name, value in os.environ.items() if name != "GPUMEM_LIMIT"}
    completed = subprocess.run([sys.executable, "-c", "import sys, torch; print('gpumem' in sys.modules)"],
                               env={**env, "GPUMEM_SEGMENTS": "plain"}, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["False"]
