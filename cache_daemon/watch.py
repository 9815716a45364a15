"""WatchEvents: one caller's stream of KV events, lost notices and snapshot pages, keys as their owner computes them."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from kvboost.v1 import cache_pb2

from cache_daemon.events import ChunkEvent, EventBatch, EventJournal, EventKind, Lost
from cache_daemon.store import HeldChunk
from cache_daemon.tenancy import PLAIN, KeySpace

RunBlocking = Callable[..., Awaitable]  # run_blocking(function, *args): function(*args) off the event loop
HeldChunks = Callable[[bytes, int], list[HeldChunk]]  # (after key, limit) -> the next stored chunks, in key order

MAX_EVENTS_PER_BATCH = 512
DEFAULT_SNAPSHOT_PAGE = 4096
# Entries take at most ~215 bytes (four digests, a 64-character tenant name): 8192 of them stay under the
# smallest --max-message-bytes (2 MiB).
MAX_SNAPSHOT_PAGE = 8192

_KINDS = {EventKind.STORED: cache_pb2.KV_EVENT_STORED, EventKind.PROMOTED: cache_pb2.KV_EVENT_PROMOTED,
          EventKind.EVICTED: cache_pb2.KV_EVENT_EVICTED, EventKind.DELETED: cache_pb2.KV_EVENT_DELETED,
          EventKind.CLEARED: cache_pb2.KV_EVENT_CLEARED}


class EventView:
    """What one caller sees of the events and of the held chunks. Each item is shown under its owning
    tenant's name with keys unscoped by that tenant's key space, i.e. as the tenant computed and sent
    them, so a router that computes keys like the service matches them. Without tenancy: every item,
    keys raw, no tenant. An admin: every item. A tenant: its own items only. Items of a namespace
    with no owner (stored by an admin) or of a tenant no longer in the tenants file keep their keys
    as stored."""

    def __init__(self, owner_of: Callable[[bytes], str | None] = lambda namespace: None,
                 space_of_owner: Callable[[str], KeySpace | None] = lambda name: None,
                 only_tenant: str | None = None) -> None:
        self._owner_of = owner_of
        self._space_of_owner = space_of_owner
        self._only_tenant = only_tenant

    def _seen_as(self, stored_namespace: bytes) -> tuple[str, KeySpace] | None:
        owner = self._owner_of(stored_namespace)
        if self._only_tenant is not None and owner != self._only_tenant:
            return None
        if owner is None:
            return "", PLAIN
        return owner, self._space_of_owner(owner) or PLAIN

    def event(self, sequence: int, event: ChunkEvent) -> cache_pb2.KvEvent | None:
        seen = self._seen_as(event.namespace)
        if seen is None:
            return None
        tenant, space = seen
        # Only LMDB is followed (TieredCache says why), so every event is of tier L1.
        return cache_pb2.KvEvent(
            sequence=sequence, kind=_KINDS[event.kind], tier=cache_pb2.KV_TIER_L1,
            namespace=space.unscope(event.namespace), prefix_key=space.unscope_optional(event.prefix_key),
            content_key=space.unscope_optional(event.content_key), num_tokens=event.num_tokens, tenant=tenant,
            parent_key=space.unscope_optional(event.parent_key), unix_time=event.unix_time)

    def snapshot_entry(self, held: HeldChunk) -> cache_pb2.KvSnapshotEntry | None:
        key, entry, parent_key = held
        seen = self._seen_as(entry.namespace)
        if seen is None:
            return None
        tenant, space = seen
        return cache_pb2.KvSnapshotEntry(
            namespace=space.unscope(entry.namespace), prefix_key=space.unscope(key),
            content_key=space.unscope_optional(entry.content_key), num_tokens=entry.num_tokens, tenant=tenant,
            parent_key=space.unscope_optional(parent_key))


def snapshot_page_size(requested: int) -> int:
    """0 asks for the default; more than MAX_SNAPSHOT_PAGE gets MAX_SNAPSHOT_PAGE."""
    return min(requested or DEFAULT_SNAPSHOT_PAGE, MAX_SNAPSHOT_PAGE)


def event_batch(view: EventView, batch: EventBatch) -> cache_pb2.KvEventBatch:
    events = (view.event(batch.first_sequence + offset, event) for offset, event in enumerate(batch.events))
    return cache_pb2.KvEventBatch(events=[event for event in events if event is not None])


def snapshot_page(view: EventView, held_chunks: HeldChunks, after: bytes,
                  limit: int) -> tuple[cache_pb2.KvSnapshotPage, bytes]:
    """The page of the snapshot after key `after`, and the key the next page starts after."""
    held = held_chunks(after, limit)
    entries = (view.snapshot_entry(item) for item in held)
    page = cache_pb2.KvSnapshotPage(entries=[entry for entry in entries if entry is not None],
                                    last=len(held) < limit)
    return page, held[-1][0] if held else after


async def watch_events(journal: EventJournal, log_name: str | None, view: EventView,
                       request: cache_pb2.WatchEventsRequest, held_chunks: HeldChunks,
                       run_blocking: RunBlocking) -> AsyncIterator[cache_pb2.WatchEventsReply]:
    """Events from the request's cursor; when they cannot follow on from it (or the caller fell behind
    while watching): `lost`, then (unless skip_snapshot) the held chunks page by page, then events from
    the lost's resume_sequence. Its cursor is taken before the first page is read, so a change during
    the snapshot may show both in a page and as a later event. Ends when the journal closes."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()
    watcher = journal.subscribe(log_name, request.incarnation, request.from_sequence,
                                lambda: loop.call_soon_threadsafe(woken.set))
    page_size = snapshot_page_size(request.snapshot_page_size)
    try:
        while True:
            woken.clear()
            taken = journal.take(watcher, MAX_EVENTS_PER_BATCH)
            if taken is None:
                return
            if isinstance(taken, Lost):
                yield cache_pb2.WatchEventsReply(incarnation=taken.incarnation, lost=cache_pb2.KvEventsLost(
                    incarnation=taken.incarnation, resume_sequence=taken.resume_sequence, reason=taken.reason))
                if not request.skip_snapshot:
                    async for page in _snapshot(view, held_chunks, page_size, run_blocking):
                        yield cache_pb2.WatchEventsReply(incarnation=taken.incarnation, snapshot=page)
            elif taken.events:
                batch = await run_blocking(event_batch, view, taken)  # unscoping costs ~14 us per event
                if batch.events:
                    yield cache_pb2.WatchEventsReply(incarnation=taken.incarnation, events=batch)
            else:
                await woken.wait()
    finally:
        journal.unsubscribe(watcher)


async def _snapshot(view: EventView, held_chunks: HeldChunks, page_size: int,
                    run_blocking: RunBlocking) -> AsyncIterator[cache_pb2.KvSnapshotPage]:
    """Every page with entries, and the last one (empty or not). Each page is read in its own short read
    transaction, so a slow reader never holds LMDB's pages (or its map growth) back."""
    after = b""
    while True:
        page, after = await run_blocking(snapshot_page, view, held_chunks, after, page_size)
        if page.entries or page.last:
            yield page
        if page.last:
            return
