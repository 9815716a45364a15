"""Keyed MACs (HMAC-SHA256) over L2 records, with key ids for rotation; the key file (pure, no I/O but the file)."""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

logger = logging.getLogger(__name__)

MAC_SIZE = 32
MIN_KEY_BYTES = 32
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,32}")
_DOMAIN = b"kvboost l2 record v1\0"  # a MAC of ours over anything else is never a valid record MAC
MAKE_KEY_HINT = ("make one (once, then copy the same file to every daemon sharing the L2, mode 0600): "
                 "python -c \"import secrets; print('k1', secrets.token_hex(32))\" > l2.key")


@dataclass(slots=True, frozen=True)
class L2Keyring:
    """The key that signs new records (`signing_id`) and every key that still verifies old ones.

    Rotation without a flush: give every daemon the new key as a second line (verify only), then
    move it to the first line (it signs), and drop the old line once its records have aged out."""

    signing_id: str
    keys: Mapping[str, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        assert self.signing_id in self.keys, f"the signing key {self.signing_id!r} is not among the keys"
        for key_id, secret in self.keys.items():
            assert _KEY_ID.fullmatch(key_id), f"key id {key_id!r} must match {_KEY_ID.pattern}"
            assert len(secret) >= MIN_KEY_BYTES, f"key {key_id!r} must be at least {MIN_KEY_BYTES} bytes"

    def sign(self, record_key: bytes, *signed_parts: bytes) -> tuple[bytes, bytes]:
        """(key id, MAC) of a record stored under record_key whose header and blob are the signed parts, in
        order (as if concatenated: the record's bytes need not be joined first)."""
        key_id = self.signing_id.encode()
        return key_id, _mac(self.keys[self.signing_id], key_id, record_key, *signed_parts)

    def holds(self, key_id: bytes) -> bool:
        return key_id.decode("ascii", errors="replace") in self.keys

    def verify(self, key_id: bytes, mac: bytes, record_key: bytes, signed_part: bytes) -> bool:
        """True only when a key we hold under key_id made this MAC for this record key and content."""
        secret = self.keys.get(key_id.decode("ascii", errors="replace"))
        if secret is None:
            return False
        return hmac.compare_digest(mac, _mac(secret, key_id, record_key, signed_part))


def _mac(secret: bytes, key_id: bytes, record_key: bytes, *signed_parts: bytes) -> bytes:
    # Lengths are fixed or prefixed: (key id, record key, content) splits one way only.
    message = hmac.new(secret, _DOMAIN, hashlib.sha256)
    message.update(bytes([len(key_id)]) + key_id + len(record_key).to_bytes(2, "little") + record_key)
    for part in signed_parts:
        message.update(part)
    return message.digest()


def parse_keyring(text: str, source: str = "the L2 key file") -> L2Keyring:
    """'KEY_ID HEX' per line, at least 32 bytes each; the first line signs, every line verifies.
    Blank lines and lines starting with # are ignored. Raises ValueError with what to fix."""
    keys: dict[str, bytes] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not _KEY_ID.fullmatch(parts[0]):
            raise ValueError(f"{source} line {number}: expected 'KEY_ID HEX' with KEY_ID matching "
                             f"{_KEY_ID.pattern}; {MAKE_KEY_HINT}")
        key_id, hex_secret = parts
        try:
            secret = bytes.fromhex(hex_secret)
        except ValueError:
            raise ValueError(f"{source} line {number}: the key of {key_id!r} is not hex") from None
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"{source} line {number}: the key of {key_id!r} has {len(secret)} bytes, "
                             f"fewer than {MIN_KEY_BYTES}; {MAKE_KEY_HINT}")
        if key_id in keys:
            raise ValueError(f"{source} line {number}: key id {key_id!r} appears twice")
        keys[key_id] = secret
    if not keys:
        raise ValueError(f"{source} holds no key; {MAKE_KEY_HINT}")
    return L2Keyring(signing_id=next(iter(keys)), keys=keys)


def load_keyring(path: Path) -> L2Keyring:
    """The keyring in path; a warning when others than the owner may read the file."""
    try:
        text = Path(path).read_text()
        mode = Path(path).stat().st_mode
    except OSError as error:
        raise ValueError(f"cannot read --l2-key-file {path}: {error}; {MAKE_KEY_HINT}") from error
    if mode & 0o077:
        logger.warning("--l2-key-file %s is readable by others than its owner (mode %o): whoever reads it can "
                       "sign L2 records every daemon serves; chmod 600 it", path, mode & 0o777)
    return parse_keyring(text, f"--l2-key-file {path}")
