"""Where the secret of every tenant's key space comes from: a file shared out of band, or this LMDB."""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from cache_daemon.errors import StartupError
from cache_daemon.tenancy import SECRET_SIZE

logger = logging.getLogger(__name__)

LOCAL_SECRET_KEY = b"tenancy_secret"  # info DB: 32 random bytes, the secret of a daemon without a secret file
FINGERPRINT_KEY = b"tenancy_fingerprint"  # info DB: which secret this LMDB's tenant chunks were stored under
MAKE_SECRET_HINT = ("make one once and give every daemon the same file (mode 0600): "
                    "python -c \"import secrets; print(secrets.token_hex(32))\" > tenancy.secret")


def secret_fingerprint(secret: bytes) -> bytes:
    """Names a secret without revealing it (kept in LMDB to notice a changed secret file)."""
    return hashlib.sha256(b"kvboost tenancy fingerprint\0" + secret).digest()[:16]


def read_secret_file(path: Path) -> bytes:
    """64 hex digits (whitespace around them ignored). Raises StartupError with what to fix."""
    try:
        text = Path(path).read_text().strip()
    except OSError as error:
        raise StartupError(f"cannot read --tenancy-secret-file {path}: {error}; {MAKE_SECRET_HINT}") from error
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_SIZE:
        raise StartupError(f"--tenancy-secret-file {path} must hold {2 * SECRET_SIZE} hex digits; {MAKE_SECRET_HINT}")
    return secret


def tenancy_secret(store, secret_file: Path | None) -> bytes:
    """The secret from secret_file, or else this LMDB's own (created once, kept with the data it guards).

    Never a new key space by surprise: the LMDB records the fingerprint of the secret its tenant chunks
    were stored under, and a daemon given a different secret file refuses to start."""
    if secret_file is None:
        return store.info_value(LOCAL_SECRET_KEY, lambda: os.urandom(SECRET_SIZE))
    secret = read_secret_file(secret_file)
    fingerprint = secret_fingerprint(secret)
    recorded = store.info_items(FINGERPRINT_KEY).get(b"")
    if recorded is not None and bytes(recorded) != fingerprint:
        raise StartupError(
            f"--tenancy-secret-file {secret_file} is not the secret this LMDB's tenant chunks were stored under "
            f"(fingerprint {bytes(recorded).hex()}, the file's {fingerprint.hex()}): with it every tenant would "
            f"start an empty key space. Give this daemon the file it used before; to start over on purpose, "
            f"start on an empty --data-dir")
    if recorded is None:
        local = store.info_items(LOCAL_SECRET_KEY).get(b"")
        if local is not None and bytes(local) != secret:
            logger.warning("tenant key spaces now derive from --tenancy-secret-file %s, not from the secret this "
                           "LMDB kept: tenant chunks stored before are no longer reachable and will be evicted",
                           secret_file)
        store.put_info({FINGERPRINT_KEY: fingerprint})
    return secret
