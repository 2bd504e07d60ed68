"""GPUMEM_METRICS_ADDR read strictly: one spelling per address, as the endpoint binds it and as
`gpumem info` shows it (Note [one address, one spelling] in gpumem.metrics)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import gpumem
from conftest import environment_without_gpumem_settings
from gpumem.settings import environment, metrics_endpoint


def gpumem_command(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumem", *args], env={**environment_without_gpumem_settings(), **env},
                          capture_output=True, text=True, timeout=300)


# What the resolver reads as an IPv4 address in another spelling: "0" and "0x0" are 0.0.0.0 to it
# (every interface), "127.1" is 127.0.0.1, "0177.0.0.1" octal; a last label of digits alone is no
# host name.
@pytest.mark.parametrize("text", ["0", "00", "0x0", "0X0", "127.1", "0177.0.0.1", "00.0.0.0", "127.0.0.01",
                                  "0x7f.1", "4294967295", "1.2.3.4.5", "256.0.0.1", "[::1]"])
def test_an_address_in_another_spelling_is_refused_naming_the_value_and_the_forms(text):
    with pytest.raises(environment.SettingError) as raised:
        environment.metrics_addr({"GPUMEM_METRICS_ADDR": text})
    message = str(raised.value)
    assert message.startswith(f"gpumem: GPUMEM_METRICS_ADDR={text!r} cannot be applied: give ")
    assert metrics_endpoint.ADDR_FORMS in message


@pytest.mark.parametrize("text, bound", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "0.0.0.0"), (" 10.1.2.3 ", "10.1.2.3"),
                                         ("::", "::"), ("::1", "::1"), ("::0", "::"),
                                         ("fe80:0:0:0:0:0:0:1", "fe80::1"), ("localhost", "localhost"),
                                         ("node-7.cluster", "node-7.cluster")])
def test_an_address_the_docs_name_is_taken_as_it_will_be_bound(text, bound):
    assert environment.metrics_addr({"GPUMEM_METRICS_ADDR": text}) == bound


def test_a_bad_address_stops_a_torch_program_at_import_with_status_2():
    completed = subprocess.run([sys.executable, "-c", "import torch\nprint('the program ran')"],
                               env={**environment_without_gpumem_settings(), "GPUMEM_LIMIT": "4GB",
                                    "GPUMEM_METRICS_ADDR": "0"}, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2 and "the program ran" not in completed.stdout
    [line] = [line for line in completed.stderr.splitlines() if "gpumem" in line]
    assert line.startswith('gpumem: bad GPUMEM_METRICS_ADDR "0": give an address to listen on: an IPv4 address')


def test_gpumem_info_shows_the_address_the_endpoint_binds():
    completed = gpumem_command("info", GPUMEM_METRICS_ADDR=" ::0 ")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "GPUMEM_METRICS_ADDR: ' ::0 ' (the metrics endpoint listens on ::)" in completed.stdout.splitlines()


def test_gpumem_info_reports_an_address_in_another_spelling_as_invalid():
    completed = gpumem_command("info", GPUMEM_METRICS_ADDR="0x0")
    assert completed.returncode == 2
    lines = completed.stdout.splitlines()
    assert "GPUMEM_METRICS_ADDR: '0x0'" in lines
    assert any(line.startswith("GPUMEM_METRICS_ADDR is invalid: give an address to listen on") for line in lines)


@pytest.mark.parametrize("addr", ["0", "127.1"])
def test_serve_metrics_refuses_an_address_in_another_spelling(addr):
    with pytest.raises(ValueError, match=rf"gpumem: bad metrics address '{addr}': give an address to listen on"):
        gpumem.serve_metrics(0, addr)
