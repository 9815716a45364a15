"""The --l2 address: redis://, rediss://, redis-cluster:// or rediss-cluster:// (pure, no I/O)."""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

_SCHEMES = {"redis": (False, False), "rediss": (False, True),
            "redis-cluster": (True, False), "rediss-cluster": (True, True)}  # scheme -> (cluster, tls)


@dataclass(slots=True, frozen=True)
class L2Address:
    """Where L2 is: one node, or the seed nodes of a cluster (any one of them is enough to start)."""

    nodes: tuple[tuple[str, int], ...]
    cluster: bool = False
    tls: bool = False
    username: str | None = None
    password: str | None = None
    db: int = 0

    def __post_init__(self) -> None:
        assert self.nodes, "an L2 address needs at least one host:port"
        assert self.cluster or len(self.nodes) == 1, "several hosts need redis-cluster://"
        assert not (self.cluster and self.db), "Redis Cluster has database 0 only"

    def redacted(self) -> str:
        """The address for logs and Stats, without the password."""
        scheme = ("rediss" if self.tls else "redis") + ("-cluster" if self.cluster else "")
        hosts = ",".join(f"{host}:{port}" for host, port in self.nodes)
        return f"{scheme}://{hosts}" + (f"/{self.db}" if self.db else "")


def parse_l2_address(text: str, password: str | None = None) -> L2Address:
    """'redis://[:password@]host:port[/db]', 'redis-cluster://h1:p1,h2:p2'; rediss for TLS.

    password: used when the address carries none (from --l2-password-file or KVBOOST_L2_PASSWORD).
    Raises ValueError with the reason."""
    scheme, separator, rest = text.strip().partition("://")
    if not separator or scheme not in _SCHEMES:
        raise ValueError(f"--l2 {text!r}: expected redis://host:port, rediss://host:port or "
                         f"redis-cluster://host1:port1,host2:port2,...")
    cluster, tls = _SCHEMES[scheme]
    credentials, _, hosts_and_path = rest.rpartition("@")
    hosts, _, path = hosts_and_path.partition("/")
    username, password_in_url = _credentials(credentials)
    nodes = tuple(_host_port(text, item) for item in hosts.split(",") if item)
    if not nodes:
        raise ValueError(f"--l2 {text!r} names no host:port")
    if len(nodes) > 1 and not cluster:
        raise ValueError(f"--l2 {text!r}: several hosts need redis-cluster://")
    if path and not path.isdigit():
        raise ValueError(f"--l2 {text!r}: the path must be a database number")
    db = int(path or 0)
    if cluster and db:
        raise ValueError(f"--l2 {text!r}: Redis Cluster has database 0 only")
    return L2Address(nodes=nodes, cluster=cluster, tls=tls, username=username,
                     password=password_in_url or password or None, db=db)


def _credentials(text: str) -> tuple[str | None, str | None]:
    if not text:
        return None, None
    username, _, password = text.partition(":")
    return unquote(username) or None, unquote(password) or None


def _host_port(text: str, item: str) -> tuple[str, int]:
    host, _, port = item.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--l2 {text!r}: {item!r} is not host:port")
    return host, int(port)
