"""Where the metrics endpoint listens: GPUMEM_METRICS_PORT's base port and GPUMEM_METRICS_ADDR's
address, and serve_metrics's port and address, read and checked (gpumem.monitoring.metrics serves).
"""
from __future__ import annotations

import ipaddress
import re
import socket

from gpumem.settings.echo import shown

DEFAULT_ADDR = "127.0.0.1"
PORT_FORMS = "a port number in 1..65535 (each process serves on it plus LOCAL_RANK)"
ADDR_FORMS = ("an address to listen on: an IPv4 address of this machine as four numbers 0..255 without leading "
              "zeros, such as 127.0.0.1 (the default: this machine only) or 0.0.0.0 (every interface: the network), "
              "an IPv6 address without brackets (:: or ::1), or a host name such as localhost (not all numbers)")
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def port_of_text(text: str) -> int:
    """GPUMEM_METRICS_PORT's base port; ValueError for anything but a number in 1..65535."""
    text = text.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= 65535):
        raise ValueError(f"bad port; give {PORT_FORMS}")
    return int(text)


def addr_of_text(text: str) -> str:
    """GPUMEM_METRICS_ADDR's address, as the endpoint binds it; ValueError for anything but an IP
    address or a host name. Note [one address, one spelling]"""
    text = text.strip()
    try:
        return str(ipaddress.ip_address(text))  # IPv4 in four decimal parts; IPv6 shortened
    except ValueError:
        if _HOST_NAME.fullmatch(text) is None or _read_as_ipv4(text) or text.rsplit(".", 1)[-1].isdigit():
            raise ValueError(f"bad address; give {ADDR_FORMS}") from None
    return text


# Note [one address, one spelling]
#   The resolver (getaddrinfo, which binds the endpoint) reads more than the dotted quad as an IPv4
#   address: "0", "00", "0x0" and "127.1" are 0.0.0.0 and 127.0.0.1 to it, so a value that looks
#   like a host name, or like a number, could listen on every interface while `gpumem info` shows
#   '0'. An address is taken only in the one form ipaddress reads (four decimal parts, none with a
#   leading zero), and shown and bound as ipaddress writes it; a host name is taken only where the
#   resolver cannot read it as an address (inet_aton refuses it, and its last label is not all
#   digits, as RFC 1123 requires of a host name).
def _read_as_ipv4(text: str) -> bool:
    try:
        socket.inet_aton(text)
    except OSError:
        return False
    return True


def checked_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"gpumem: metrics port {shown(port)} ({type(port).__name__}) is not an int; give 0..65535")
    if not 0 <= port <= 65535:
        raise ValueError(f"gpumem: bad metrics port {port}: give 0..65535 (0: any free port)")
    return port


def checked_addr(addr: object) -> str:
    if not isinstance(addr, str) or not addr or len(addr) > 255:
        raise TypeError(f"gpumem: metrics address {addr!r:.80} is not a host name or IP address; give e.g. "
                        "'127.0.0.1' or '0.0.0.0'")
    try:
        return addr_of_text(addr)
    except ValueError:
        raise ValueError(f"gpumem: bad metrics address {shown(addr)}: give {ADDR_FORMS}") from None
