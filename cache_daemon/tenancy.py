"""Tenants of a shared daemon: the tenants file, and each tenant's private key space (pure, no I/O but the file)."""
from __future__ import annotations

import hashlib
import hmac
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from cache_daemon.config import parse_size
from cache_daemon.entry import DIGEST_SIZE
from kvboost_common.principals import NAME_PATTERN, Principal, load_principals, parse_principals

SECRET_SIZE = 32
# Four Feistel rounds make a strong pseudo-random permutation (Luby-Rackoff) of the 32-byte digests.
_NUM_ROUNDS = 4
_HALF = DIGEST_SIZE // 2
_TENANT_NAME = NAME_PATTERN
_EXTRA_FIELDS = ("max_bytes",)


@dataclass(slots=True, frozen=True)
class Tenant:
    """Who a bearer token speaks for. An admin sees and manages every key as stored; a tenant only its own."""

    name: str
    admin: bool = False
    max_bytes: int | None = None  # the tenant's share of the budget; None: no share of its own

    def __post_init__(self) -> None:
        assert _TENANT_NAME.fullmatch(self.name), f"tenant name {self.name!r} must match {_TENANT_NAME.pattern}"
        assert self.max_bytes is None or self.max_bytes > 0, f"max_bytes must be positive, got {self.max_bytes}"


# The tenant of the RPC being served; set by the token interceptor, None when tenancy is off.
current_tenant: ContextVar[Tenant | None] = ContextVar("tenant", default=None)


class KeySpace:
    """A tenant's private layout of the shared key space: a keyed permutation of 32-byte digests.

    stored = scope(sent) for every key, namespace and content key a tenant sends, unscope() turns
    stored keys back into the tenant's own. Without the daemon's secret no one can compute where
    another tenant's keys are stored, so a tenant can neither read nor overwrite them. A keyed
    permutation (4-round Feistel over BLAKE2b) rather than an XOR mask: XOR is linear, so one
    leaked (sent, stored) pair would give away the whole mask; a PRP leaks nothing per pair.
    """

    __slots__ = ("_round_keys",)

    def __init__(self, tenant_secret: bytes) -> None:
        assert len(tenant_secret) == SECRET_SIZE, f"tenant secret must be {SECRET_SIZE} bytes"
        self._round_keys = [hmac.digest(tenant_secret, b"feistel round %d" % index, "sha256")
                            for index in range(_NUM_ROUNDS)]

    def scope(self, digest: bytes) -> bytes:
        assert len(digest) == DIGEST_SIZE, f"a key must be {DIGEST_SIZE} bytes, got {len(digest)}"
        left, right = digest[:_HALF], digest[_HALF:]
        for round_key in self._round_keys:
            left, right = right, _xor(left, _round(round_key, right))
        return left + right

    def unscope(self, stored: bytes) -> bytes:
        assert len(stored) == DIGEST_SIZE, f"a key must be {DIGEST_SIZE} bytes, got {len(stored)}"
        left, right = stored[:_HALF], stored[_HALF:]
        for round_key in reversed(self._round_keys):
            left, right = _xor(right, _round(round_key, left)), left
        return left + right

    def scope_all(self, digests: Iterable[bytes]) -> list[bytes]:
        return [self.scope(digest) for digest in digests]

    def scope_optional(self, digest: bytes) -> bytes:
        """Empty stays empty (a chunk that is not content-addressed)."""
        return self.scope(digest) if digest else digest

    def unscope_optional(self, stored: bytes) -> bytes:
        return self.unscope(stored) if stored else stored


class PlainSpace(KeySpace):
    """Keys as sent: no tenancy (one trusted caller), or an admin."""

    __slots__ = ()

    def __init__(self) -> None:
        pass

    def scope(self, digest: bytes) -> bytes:
        return digest

    def unscope(self, stored: bytes) -> bytes:
        return stored

    def scope_all(self, digests: Iterable[bytes]) -> list[bytes]:
        return list(digests)


PLAIN = PlainSpace()


def _round(round_key: bytes, half: bytes) -> bytes:
    return hashlib.blake2b(half, key=round_key, digest_size=_HALF).digest()


def _xor(left: bytes, right: bytes) -> bytes:
    return (int.from_bytes(left, "little") ^ int.from_bytes(right, "little")).to_bytes(_HALF, "little")


def tenant_secret(daemon_secret: bytes, tenant_name: str) -> bytes:
    """The tenant's own key, derived from the daemon's secret: the same name gets the same space after
    a restart or a token rotation, and a renamed tenant starts empty."""
    return hmac.digest(daemon_secret, b"kvboost tenant\0" + tenant_name.encode(), "sha256")


class Tenancy:
    """The tenants of one daemon: their key spaces and which stored namespaces each one owns."""

    def __init__(self, daemon_secret: bytes, tenants: Iterable[Tenant],
                 namespace_owners: Mapping[bytes, str] | None = None) -> None:
        assert len(daemon_secret) == SECRET_SIZE, f"the daemon secret must be {SECRET_SIZE} bytes"
        self.tenants = {tenant.name: tenant for tenant in tenants}
        self._spaces = {name: KeySpace(tenant_secret(daemon_secret, name)) for name, tenant in self.tenants.items()
                        if not tenant.admin}
        self._owners: dict[bytes, str] = dict(namespace_owners or {})

    def space_of(self, tenant: Tenant) -> KeySpace:
        return PLAIN if tenant.admin else self._spaces[tenant.name]

    def space_named(self, name: str) -> KeySpace | None:
        """The key space of the tenant called `name`; None for an admin or a name not in the tenants file."""
        return self._spaces.get(name)

    def owner_of(self, stored_namespace: bytes) -> str | None:
        return self._owners.get(stored_namespace)

    def new_namespaces(self, tenant: Tenant, stored_namespaces: Iterable[bytes]) -> dict[bytes, str]:
        """The namespaces among these that no owner is recorded for yet, mapped to this tenant."""
        if tenant.admin:
            return {}
        return {namespace: tenant.name for namespace in set(stored_namespaces) if namespace not in self._owners}

    def record_owners(self, owners: Mapping[bytes, str]) -> None:
        self._owners.update(owners)


def parse_tenants(document: object, base_dir: Path) -> dict[str, Tenant]:
    """Token -> Tenant from the tenants file's JSON (kvboost_common.principals, plus `max_bytes`):

        {"tenants": {"alice": {"token_file": "alice.token", "max_bytes": "2G"},
                     "ops": {"token": "...", "admin": true}}}

    Raises ValueError on anything else: a missing or shared token, an unknown field, a bad name.
    """
    return _tenants(parse_principals(document, base_dir, extra_fields=_EXTRA_FIELDS))


def load_tenants_file(path: Path) -> dict[str, Tenant]:
    """Token -> Tenant; token_file paths are relative to the tenants file's folder."""
    return _tenants(load_principals(path, extra_fields=_EXTRA_FIELDS))


def _tenants(principals: Mapping[str, Principal]) -> dict[str, Tenant]:
    tenants_by_token = {}
    for token, principal in principals.items():
        max_bytes = principal.extra.get("max_bytes")
        if max_bytes is not None:
            max_bytes = parse_size(str(max_bytes))
            if max_bytes <= 0:
                raise ValueError(f"tenant {principal.name!r}: max_bytes must be positive")
        tenants_by_token[token] = Tenant(name=principal.name, admin=principal.admin, max_bytes=max_bytes)
    return tenants_by_token
