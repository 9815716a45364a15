"""Small builders for router tests: KV events and WatchEvents replies, keys that read as their names."""
from __future__ import annotations

from kvboost.v1 import cache_pb2

NAMESPACE = bytes(32)
INCARNATION = "inc-1"


def key(name: str) -> bytes:
    """A 32-byte key whose bytes start with its name, so a failing assertion reads."""
    return name.encode().ljust(32, b".")


def event(sequence: int, kind: int = cache_pb2.KV_EVENT_STORED, prefix: str = "", content: str = "",
          tenant: str = "", tier: int = cache_pb2.KV_TIER_L1, namespace: bytes = NAMESPACE,
          num_tokens: int = 4) -> cache_pb2.KvEvent:
    return cache_pb2.KvEvent(sequence=sequence, kind=kind, tier=tier, namespace=namespace,
                             prefix_key=key(prefix) if prefix else b"", content_key=key(content) if content else b"",
                             num_tokens=num_tokens, tenant=tenant)


def events(*batch: cache_pb2.KvEvent, incarnation: str = INCARNATION) -> cache_pb2.WatchEventsReply:
    return cache_pb2.WatchEventsReply(incarnation=incarnation, events=cache_pb2.KvEventBatch(events=batch))


def lost(resume_sequence: int, incarnation: str = INCARNATION,
         reason: str = "new incarnation") -> cache_pb2.WatchEventsReply:
    return cache_pb2.WatchEventsReply(incarnation=incarnation, lost=cache_pb2.KvEventsLost(
        incarnation=incarnation, resume_sequence=resume_sequence, reason=reason))


def snapshot(*prefixes: str, last: bool = True, tenant: str = "", content: dict[str, str] | None = None,
             incarnation: str = INCARNATION) -> cache_pb2.WatchEventsReply:
    entries = [cache_pb2.KvSnapshotEntry(namespace=NAMESPACE, prefix_key=key(name), tenant=tenant, num_tokens=4,
                                         content_key=key(content[name]) if content and name in content else b"")
               for name in prefixes]
    return cache_pb2.WatchEventsReply(incarnation=incarnation, snapshot=cache_pb2.KvSnapshotPage(
        entries=entries, last=last))
