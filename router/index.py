"""Which chunks each replica's daemon holds in L1, as its KV events said: prefix keys and content keys, per tenant.

Pure bookkeeping (no I/O): the event follower feeds it, the scorer asks it. Keys are the ones the owning tenant
computes (the daemon un-permutes its per-tenant key space before it publishes), so a request's keys, computed as
a replica computes them, are looked up here as they are.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from kvboost.v1 import cache_pb2

# Events that put a chunk into L1 and those that take it out; CLEARED empties a whole namespace.
_ADDED = (cache_pb2.KV_EVENT_STORED, cache_pb2.KV_EVENT_PROMOTED)
_REMOVED = (cache_pb2.KV_EVENT_EVICTED, cache_pb2.KV_EVENT_DELETED)


@dataclass(slots=True, frozen=True)
class HeldChunk:
    namespace: bytes  # one shared object per namespace (DaemonHoldings interns them): the index may be large
    content_key: bytes  # empty when the chunk is not content-addressed


@dataclass(slots=True)
class TenantHoldings:
    """One tenant's chunks in one daemon: prefix key -> chunk, and how many held chunks carry each content key."""

    chunks: dict[bytes, HeldChunk] = field(default_factory=dict)
    content: Counter[bytes] = field(default_factory=Counter)

    def add(self, prefix_key: bytes, chunk: HeldChunk) -> None:
        self.remove(prefix_key)  # a key stored again may carry another content key
        self.chunks[prefix_key] = chunk
        if chunk.content_key:
            self.content[chunk.content_key] += 1

    def remove(self, prefix_key: bytes) -> None:
        chunk = self.chunks.pop(prefix_key, None)
        if chunk is not None and chunk.content_key:
            self.content[chunk.content_key] -= 1
            if not self.content[chunk.content_key]:
                del self.content[chunk.content_key]

    def clear(self, namespace: bytes) -> None:
        for prefix_key in [key for key, chunk in self.chunks.items() if chunk.namespace == namespace]:
            self.remove(prefix_key)


class DaemonHoldings:
    """Every tenant's chunks in one daemon's L1.

    Lookups name a tenant (the one the replica's service writes as) or None for any tenant: a router that follows
    the daemon with a tenant's token only ever sees that tenant's events anyway.
    """

    def __init__(self) -> None:
        self._tenants: dict[str, TenantHoldings] = {}
        self._namespaces: dict[bytes, bytes] = {}

    @property
    def num_chunks(self) -> int:
        return sum(len(holdings.chunks) for holdings in list(self._tenants.values()))  # also read by /metrics

    def apply(self, event: cache_pb2.KvEvent) -> None:
        """One event; L2 events change nothing here (a chunk in the shared tier is as near to every replica)."""
        if event.tier == cache_pb2.KV_TIER_L2:
            return
        holdings = self._tenants.setdefault(event.tenant, TenantHoldings())
        if event.kind in _ADDED:
            holdings.add(event.prefix_key, self._chunk(event.namespace, event.content_key))
        elif event.kind in _REMOVED:
            holdings.remove(event.prefix_key)
        elif event.kind == cache_pb2.KV_EVENT_CLEARED:
            holdings.clear(event.namespace)

    def replace_with(self, other: DaemonHoldings) -> None:
        """Takes over what `other` holds (a finished snapshot); this object stays the one lookups see."""
        self._tenants, self._namespaces = other._tenants, other._namespaces

    def add_snapshot(self, entries: Iterable[cache_pb2.KvSnapshotEntry]) -> None:
        for entry in entries:
            holdings = self._tenants.setdefault(entry.tenant, TenantHoldings())
            holdings.add(entry.prefix_key, self._chunk(entry.namespace, entry.content_key))

    def holds_prefix(self, prefix_key: bytes, tenant: str | None = None) -> bool:
        return any(prefix_key in holdings.chunks for holdings in self._of(tenant))

    def holds_content(self, content_key: bytes, tenant: str | None = None) -> bool:
        return any(content_key in holdings.content for holdings in self._of(tenant))

    def _chunk(self, namespace: bytes, content_key: bytes) -> HeldChunk:
        return HeldChunk(self._namespaces.setdefault(namespace, namespace), content_key)

    def _of(self, tenant: str | None) -> list[TenantHoldings]:
        if tenant is None:
            return list(self._tenants.values())
        holdings = self._tenants.get(tenant)
        return [] if holdings is None else [holdings]
