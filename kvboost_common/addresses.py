"""Listen and target addresses: HOST:PORT over TCP, or unix:PATH for a socket on this host."""
from __future__ import annotations

import ipaddress

UNIX_PREFIX = "unix:"


def is_unix(address: str) -> bool:
    """True for gRPC's unix-socket form (unix:relative/path, unix:/abs/path or unix:///abs/path)."""
    return address.startswith(UNIX_PREFIX)


def split_host_port(address: str) -> tuple[str, int]:
    """('127.0.0.1', 50052) for '127.0.0.1:50052' ('[::1]:1' keeps its brackets). Raises ValueError."""
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT or unix:PATH, got {address!r}")
    return host, int(port)


def check_listen_address(address: str) -> None:
    """Raises ValueError unless the address is HOST:PORT or unix:PATH with a path."""
    if is_unix(address):
        if not address[len(UNIX_PREFIX):].lstrip("/"):
            raise ValueError(f"a unix socket address needs a path, got {address!r}")
        return
    split_host_port(address)


def is_local(address: str) -> bool:
    """True when only this host can reach the address: a unix socket, localhost or a loopback IP."""
    if is_unix(address):
        return True
    host = split_host_port(address)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve beyond loopback
        return False
