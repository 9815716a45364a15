"""The client side of rediss://: a private CA and this daemon's certificate (pure, no I/O)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class L2TlsFiles:
    """For rediss://: a private CA that signed Redis's certificate, and this daemon's client certificate
    (when Redis asks for one: tls-auth-clients yes). Without a CA the system's trust store is used."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    def __post_init__(self) -> None:
        assert (self.cert_file is None) == (self.key_file is None), "a client certificate needs its key"

    def redis_options(self) -> dict:
        options: dict = {"ssl_cert_reqs": "required"}
        if self.ca_file is not None:
            options["ssl_ca_certs"] = str(self.ca_file)
        if self.cert_file is not None:
            options.update(ssl_certfile=str(self.cert_file), ssl_keyfile=str(self.key_file))
        return options
