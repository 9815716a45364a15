"""Who a request speaks for: no key, one shared key, or a keys file that maps API keys to tenants.

With tenants, the tenant is the request's cache scope end to end: the salt the service mixes into the
cache namespace is derived from the tenant's name and the client's own `cache_salt`, so a client can
neither choose another tenant's scope nor learn from `cached_tokens` what another tenant sent.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Mapping

from kvboost_common.principals import Principal, load_principals

_BEARER = b"Bearer "


@dataclass(slots=True, frozen=True)
class Caller:
    """tenant None: no tenants are configured; the client's cache_salt is used as it is.
    admin: may pin and unpin chunks and act in any tenant's scope."""

    tenant: str | None
    admin: bool

    def cache_salt(self, client_salt: str | None, tenant: str | None = None) -> str:
        """The salt sent to the service. `tenant` (admins only, checked by the caller) acts in that
        tenant's scope. A tenant's salts start with `tenant=NAME;`, which no raw salt of another tenant
        can produce: tenants' salts are always derived here."""
        scope = tenant or self.tenant
        if scope is None:
            return client_salt or ""
        return f"tenant={scope};salt={client_salt or ''}"


TRUSTED = Caller(None, admin=True)  # no keys configured, or the one shared key


class Keys:
    """The gateway's API keys: none (every caller trusted), one shared key, or tenants from a keys file."""

    def __init__(self, single_key: str | None = None, tenants: Mapping[str, Principal] | None = None) -> None:
        assert single_key is None or tenants is None, "one key or a keys file, not both"
        self._single = f"Bearer {single_key}".encode() if single_key else None
        # By the key's SHA-256: a dict probe on a digest leaks nothing about the keys' bytes through timing.
        self._tenants = {_digest(key.encode()): Caller(principal.name, principal.admin)
                         for key, principal in (tenants or {}).items()}

    @classmethod
    def from_files(cls, api_key: str | None, keys_file: str) -> Keys:
        return cls(api_key, load_principals(keys_file) if keys_file else None)

    @property
    def tenant_names(self) -> list[str]:
        return sorted(caller.tenant for caller in self._tenants.values())

    def caller(self, authorization: bytes) -> Caller | None:
        """The caller an `Authorization` header value speaks for; None when it names no key."""
        if self._single is not None:
            return TRUSTED if hmac.compare_digest(authorization, self._single) else None
        if not self._tenants:
            return TRUSTED
        if not authorization.startswith(_BEARER):
            return None
        return self._tenants.get(_digest(authorization[len(_BEARER):]))

    def knows_tenant(self, name: str) -> bool:
        return any(caller.tenant == name for caller in self._tenants.values())


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
