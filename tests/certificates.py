"""Test certificates made with the openssl CLI (no Python crypto dependency): a self-signed one for 127.0.0.1."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

requires_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                      reason="needs the openssl CLI to make a test certificate")


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """(certificate, private key) PEM files, self-signed for 127.0.0.1 and localhost, valid one day."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key
