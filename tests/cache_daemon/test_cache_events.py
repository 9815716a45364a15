"""ChunkCache publishes every change of LMDB after its commit: stored, evicted, deleted, corrupted, cleared."""
from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import pytest

from cache_daemon.cache import ChunkCache
from cache_daemon.events import ChunkEvent, EventJournal, EventKind
from cache_daemon.store import LmdbStore
from tests.cache_daemon.test_cache import FakeClock, flip_byte, incoming, put
from tests.daemon_support import NAMESPACE, digest, make_chunk

OTHER_NAMESPACE = digest("another model")


def open_cache(path: Path, max_bytes: int = 10_000, clock: FakeClock | None = None) -> ChunkCache:
    return ChunkCache(LmdbStore(path, map_size=1 << 20), max_bytes, float("inf"), clock=clock or FakeClock(),
                      events=EventJournal(history=1000))


@pytest.fixture()
def cache(tmp_path: Path):
    cache = open_cache(tmp_path / "lmdb")
    yield cache
    cache.close()


def published(cache: ChunkCache, start: int = 0) -> list[ChunkEvent]:
    journal = cache.events
    return journal.take(journal.subscribe(None, journal.incarnation, start, lambda: None), 10_000).events


def kinds_and_keys(events: list[ChunkEvent]) -> list[tuple[EventKind, bytes]]:
    return [(event.kind, event.prefix_key) for event in events]


def test_stored_chunks_are_published_with_their_keys_tokens_and_parent(cache: ChunkCache) -> None:
    plain, document = make_chunk("plain"), make_chunk("document", content_key=digest("document tokens"), num_tokens=7)
    continuation = dataclasses.replace(incoming(make_chunk("continuation")), parent_key=plain.key,
                                       token_ids=struct.pack("<2I", 5, 6))
    put(cache, plain, document)
    cache.put_many([continuation])
    put(cache, plain)  # already stored: nothing changes, nothing is published
    assert published(cache) == [
        ChunkEvent(EventKind.STORED, NAMESPACE, plain.key, b"", 16, b"", 1000.0),
        ChunkEvent(EventKind.STORED, NAMESPACE, document.key, document.content_key, 7, b"", 1000.0),
        ChunkEvent(EventKind.STORED, NAMESPACE, continuation.key, b"", 16, plain.key, 1000.0),
    ]


def test_eviction_is_published_before_the_chunks_it_made_room_for(tmp_path: Path) -> None:
    clock = FakeClock()
    cache = open_cache(tmp_path / "lmdb", clock=clock)
    try:
        old = [make_chunk(f"old {index}", 3000) for index in range(3)]
        for chunk in old:  # old[0] is the least recently used
            put(cache, chunk)
            clock.now += 1
        newcomer = make_chunk("newcomer", 3000)  # 12,000 bytes would exceed the 10,000-byte budget
        put(cache, newcomer)
        assert kinds_and_keys(published(cache, start=3)) == [(EventKind.EVICTED, old[0].key),
                                                            (EventKind.STORED, newcomer.key)]
    finally:
        cache.close()


def test_deletes_by_key_publish_only_the_chunks_that_were_stored(cache: ChunkCache) -> None:
    kept, gone = make_chunk("kept"), make_chunk("gone", content_key=digest("gone tokens"))
    put(cache, kept, gone)
    cache.delete_keys([gone.key, digest("never stored"), gone.key])
    assert published(cache, start=2) == [
        ChunkEvent(EventKind.DELETED, NAMESPACE, gone.key, gone.content_key, 16, unix_time=1000.0)]


def test_deleting_a_namespace_publishes_one_cleared_event(cache: ChunkCache) -> None:
    put(cache, make_chunk("a"), make_chunk("b"), make_chunk("other", namespace=OTHER_NAMESPACE))
    cache.delete_namespace(NAMESPACE)
    assert published(cache, start=3) == [ChunkEvent(EventKind.CLEARED, NAMESPACE, unix_time=1000.0)]


def test_a_corrupted_blob_dropped_on_read_is_published_as_deleted(tmp_path: Path) -> None:
    bad = make_chunk("bad")
    cache = open_cache(tmp_path / "lmdb")
    put(cache, bad)
    cache.close()
    flip_byte(tmp_path / "lmdb", bad.key)
    cache = open_cache(tmp_path / "lmdb")
    try:
        assert cache.read(bad.key, bytes) is None
        assert kinds_and_keys(published(cache)) == [(EventKind.DELETED, bad.key)]
    finally:
        cache.close()


def test_a_restart_with_a_smaller_budget_publishes_its_evictions(tmp_path: Path) -> None:
    chunks = [make_chunk(f"chunk {index}", 3000) for index in range(3)]
    cache = open_cache(tmp_path / "lmdb")
    put(cache, *chunks)
    cache.close()
    cache = open_cache(tmp_path / "lmdb", max_bytes=6000)
    try:
        assert [kind for kind, _ in kinds_and_keys(published(cache))] == [EventKind.EVICTED]
    finally:
        cache.close()


def test_held_chunks_pages_through_every_key_in_order_with_parents(cache: ChunkCache) -> None:
    chunks = [make_chunk(f"held {index}", 100) for index in range(5)]
    put(cache, *chunks)
    child = dataclasses.replace(incoming(make_chunk("child", 100)), parent_key=chunks[0].key,
                                token_ids=struct.pack("<I", 9))
    cache.put_many([child])
    pages, after = [], b""
    while not pages or len(pages[-1]) == 2:
        pages.append(cache.held_chunks(after, 2))
        after = pages[-1][-1][0] if pages[-1] else after
    keys = [key for page in pages for key, _, _ in page]
    assert [len(page) for page in pages] == [2, 2, 2, 0]
    assert keys == sorted([chunk.key for chunk in chunks] + [child.key])
    assert {key: parent for page in pages for key, _, parent in page if parent} == {child.key: chunks[0].key}
