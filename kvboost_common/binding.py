"""Binds a grpc.aio server to its listen address, with TLS when a certificate and key are given."""
from __future__ import annotations

from pathlib import Path

import grpc


def bind(server: grpc.aio.Server, listen: str, tls_cert: Path | str | None = None,
         tls_key: Path | str | None = None) -> int:
    """Adds the port and returns it (port 0 in `listen` picks a free one).

    Raises:
        OSError: the address is taken or not local (grpc returns port 0 instead of raising).
    """
    if not tls_cert:
        port = server.add_insecure_port(listen)
    else:
        key, chain = Path(tls_key).read_bytes(), Path(tls_cert).read_bytes()
        port = server.add_secure_port(listen, grpc.ssl_server_credentials([(key, chain)]))
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the address is taken or not local")
    return port
