"""GPUMEM_LIMIT, applied when gpumem is installed, over fake devices (fake_c.py)."""
import pytest

import gpumem
from fake_c import GiB

MiB = 1 << 20


def test_a_single_spec_caps_every_device_at_enable(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "1GB")
    gpumem.enable()
    assert fake_c.limits() == [1 * GiB, 1 * GiB]


def test_per_device_specs_cap_each_device(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "0:1GB,1:25%")
    gpumem.enable()
    assert fake_c.limits() == [1 * GiB, 2 * GiB]


def test_a_device_not_listed_stays_uncapped(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "1:512MB")
    gpumem.enable()
    assert fake_c.limits() == [8 * GiB, 512 * MiB]


def test_the_first_set_limit_applies_it_for_the_other_devices(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "1GB")
    gpumem.set_limit("3GB", device=1)
    assert fake_c.limits() == [1 * GiB, 3 * GiB]


def test_an_explicit_set_limit_overrides_it(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "1GB")
    gpumem.enable()
    gpumem.set_limit("3GB")
    assert fake_c.limits() == [3 * GiB, 3 * GiB]


def test_a_second_enable_does_not_apply_it_again(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "1GB")
    gpumem.enable()
    gpumem.set_limit("3GB")
    gpumem.enable()
    assert fake_c.limits() == [3 * GiB, 3 * GiB]


@pytest.mark.parametrize("value", ["lots", "", "0:4GB,0:8GB", "4GB,1:2GB", "1:-1GB", "150%"])
def test_a_bad_value_is_an_error_naming_the_variable_its_value_and_the_forms(fake_c, monkeypatch, value):
    monkeypatch.setenv("GPUMEM_LIMIT", value)
    with pytest.raises(ValueError) as caught:
        gpumem.enable()
    message = str(caught.value)
    assert f"GPUMEM_LIMIT={value!r}" in message
    assert gpumem._C.limit_forms in message


def test_a_bad_value_leaves_gpumem_uninstalled(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "lots")
    with pytest.raises(ValueError):
        gpumem.enable()
    assert not fake_c.installed
    assert fake_c.limits() == [8 * GiB, 8 * GiB]


def test_a_bad_value_stops_set_limit_too(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "lots")
    with pytest.raises(ValueError, match="GPUMEM_LIMIT"):
        gpumem.set_limit("1GB")
    assert not fake_c.installed
    assert fake_c.limits() == [8 * GiB, 8 * GiB]


@pytest.mark.parametrize("value, reason", [("0:1GB,5:1GB", "no CUDA device 5"), ("0:9GB", "more than the device total"),
                                           ("1:1GB,0:9GB", "more than the device total")])
def test_what_does_not_fit_the_devices_is_an_error_at_their_first_use(fake_c, monkeypatch, value, reason):
    # enable() asks no device; the first call that does gets the error, and so does every next one.
    monkeypatch.setenv("GPUMEM_LIMIT", value)
    gpumem.enable()
    for _ in range(2):
        with pytest.raises(ValueError) as caught:
            gpumem.get_limit(0)
        message = str(caught.value)
        assert message.startswith(f'gpumem: bad GPUMEM_LIMIT "{value}": ') and reason in message


def test_what_does_not_fit_the_devices_stops_set_limit_and_changes_nothing(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "0:9GB")
    with pytest.raises(ValueError, match="GPUMEM_LIMIT"):
        gpumem.set_limit("1GB")
    monkeypatch.setattr(fake_c, "_pending", None)  # looks at the devices past the setup
    assert fake_c.limits() == [8 * GiB, 8 * GiB]


def test_enable_asks_no_device(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "0:1GB,1:50%")
    gpumem.enable()
    assert fake_c.device_count_calls == 0
    assert fake_c.install_args == [("0:1GB,1:50%", None)]


@pytest.mark.parametrize("value, shown", [
    ("4\x1b[2JGB", "GPUMEM_LIMIT='4\\x1b[2JGB'"),
    ("0:4GB,1:\x07", "GPUMEM_LIMIT='0:4GB,1:\\x07'"),
    ("9" * 10_000_000, "GPUMEM_LIMIT='" + "9" * 64 + "'… (10000000 characters)"),
], ids=["escape", "bell", "ten-megabytes"])
def test_a_hostile_value_is_shown_escaped_and_cut(fake_c, monkeypatch, value, shown):
    monkeypatch.setenv("GPUMEM_LIMIT", value)
    with pytest.raises(ValueError) as caught:
        gpumem.enable()
    message = str(caught.value)
    assert message.startswith(f"gpumem: {shown} cannot be applied: ")
    assert message.isprintable() and len(message) < 2000


def test_a_value_that_is_not_utf_8_is_an_error_naming_the_byte_and_the_forms(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_LIMIT", "4\udcffGB")  # what Python makes of GPUMEM_LIMIT=$'4\xffGB'
    with pytest.raises(ValueError) as caught:
        gpumem.enable()
    message = str(caught.value)
    assert message.startswith("gpumem: GPUMEM_LIMIT='4\\udcffGB' cannot be applied: it holds the byte 0xff "
                              "(character 2), which is not UTF-8 text. Accepted forms: ")
    assert message.isprintable() and not fake_c.installed
