"""ChunkCache: budget, eviction, pins, write-behind frequencies, integrity, lookups."""
from __future__ import annotations

import math
from pathlib import Path

import lmdb
import pytest

from cache_daemon.cache import ChunkCache
from cache_daemon.entry import IncomingChunk
from cache_daemon.errors import BudgetExceeded, NotFound
from cache_daemon.store import BLOBS_DB, LmdbStore
from tests.daemon_support import NAMESPACE, SampleChunk, digest, make_chunk

OTHER_NAMESPACE = digest("another model")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def incoming(chunk: SampleChunk) -> IncomingChunk:
    return IncomingChunk(key=chunk.key, namespace=chunk.namespace, content_key=chunk.content_key,
                         num_tokens=chunk.num_tokens, checksum=chunk.checksum, pinned=chunk.pinned, blob=chunk.blob)


def open_cache(path: Path, max_bytes: int = 10_000, half_life: float = math.inf, clock=None) -> ChunkCache:
    return ChunkCache(LmdbStore(path, map_size=1 << 20), max_bytes, half_life, clock=clock or FakeClock())


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture()
def cache(tmp_path: Path, clock: FakeClock):
    cache = open_cache(tmp_path / "lmdb", clock=clock)
    yield cache
    cache.close()


def put(cache: ChunkCache, *chunks: SampleChunk):
    return cache.put_many([incoming(chunk) for chunk in chunks])


def read_blob(cache: ChunkCache, chunk: SampleChunk) -> bytes | None:
    result = cache.read(chunk.key, bytes)
    return None if result is None else result[1]


def test_put_then_read_is_bit_exact_and_counted(cache: ChunkCache) -> None:
    chunk = make_chunk("a", 3000)
    result = put(cache, chunk, chunk)
    assert (result.stored, result.already_present, result.evicted, result.bytes_stored) == (1, 1, 0, 3000)
    assert read_blob(cache, chunk) == chunk.blob
    assert read_blob(cache, make_chunk("absent")) is None
    stats = cache.stats()
    assert (stats.num_entries, stats.num_bytes) == (1, 3000)
    assert (stats.counters.hits, stats.counters.misses, stats.counters.bytes_read) == (1, 1, 3000)
    assert put(cache, chunk).already_present == 1


def test_budget_evicts_least_used_first_and_is_never_exceeded(cache: ChunkCache, clock: FakeClock) -> None:
    chunks = [make_chunk(i, 2000) for i in range(5)]  # 10_000 bytes: exactly the budget
    for chunk in chunks:
        clock.now += 1
        put(cache, chunk)
    # Chunk 0 is read twice, chunk 3 once; the rest only stored.
    cache.lookup(NAMESPACE, [chunks[0].key], [])
    cache.lookup(NAMESPACE, [chunks[0].key, chunks[3].key], [])
    assert cache.flush_hits() == 2
    clock.now += 1
    result = put(cache, make_chunk("new", 5000))
    # 5000 bytes to free: the three chunks never read, oldest first.
    assert (result.stored, result.evicted) == (1, 3)
    assert cache.entry(chunks[0].key).frequency == 3.0 and cache.entry(chunks[3].key).frequency == 2.0
    assert [cache.entry(chunk.key) is None for chunk in chunks] == [False, True, True, False, True]
    assert cache.stats().num_bytes == 9000
    assert cache.stats().counters.evictions == 3


def test_a_blob_larger_than_the_budget_is_refused(cache: ChunkCache) -> None:
    with pytest.raises(BudgetExceeded, match="more than the whole budget"):
        put(cache, make_chunk("huge", 10_001))
    assert cache.stats().num_entries == 0


def test_pinned_chunks_stay_and_can_fill_the_budget(cache: ChunkCache, clock: FakeClock) -> None:
    pinned = make_chunk("pinned", 6000)
    put(cache, pinned)
    clock.now += 1
    assert cache.set_pinned([pinned.key, digest("absent")], True).missing == [digest("absent")]
    assert put(cache, make_chunk("x", 4000)).evicted == 0
    # 5000 more bytes: only "x" can go; "y" then fits beside the pinned chunk.
    assert put(cache, make_chunk("y", 4000)).evicted == 1
    assert cache.entry(pinned.key).pinned
    with pytest.raises(BudgetExceeded, match="pinned chunks fill the budget"):
        put(cache, make_chunk("z", 4500))
    # Unpinned, it is the oldest chunk: the first to go.
    cache.set_pinned([pinned.key], False)
    assert put(cache, make_chunk("z", 4500)).stored == 1
    assert cache.entry(pinned.key) is None


def test_pinning_only_unknown_keys_is_not_found(cache: ChunkCache) -> None:
    with pytest.raises(NotFound):
        cache.set_pinned([digest("absent")], True)


def test_incoming_chunks_beyond_the_room_are_dropped_in_order(cache: ChunkCache) -> None:
    chunks = [make_chunk(i, 4000) for i in range(4)]
    result = put(cache, *chunks)
    # 16_000 bytes for a 10_000 budget: the first two fit, the rest of the chain is dropped.
    assert (result.stored, result.evicted) == (2, 2)
    assert [cache.entry(chunk.key) is not None for chunk in chunks] == [True, True, False, False]


def test_hits_are_written_behind_and_survive_reopening(tmp_path: Path) -> None:
    clock = FakeClock()
    cache = open_cache(tmp_path / "lmdb", half_life=100.0, clock=clock)
    chunks = [make_chunk(i) for i in range(3)]
    put(cache, *chunks)
    cache.lookup(NAMESPACE, [chunk.key for chunk in chunks], [])
    cache.lookup(NAMESPACE, [chunks[0].key], [])
    # Nothing changes until the flush.
    assert cache.entry(chunks[0].key).frequency == 1.0
    assert cache.stats().num_unflushed_hits == 4
    clock.now += 100.0  # one half-life
    cache.flush_hits()
    assert cache.stats().num_unflushed_hits == 0
    assert cache.entry(chunks[0].key).frequency == 0.5 + 2
    assert cache.entry(chunks[1].key).frequency == 0.5 + 1
    before = {chunk.key: cache.entry(chunk.key) for chunk in chunks}
    cache.lookup(NAMESPACE, [chunks[2].key], [])
    cache.close()  # flushes the pending hit
    reopened = open_cache(tmp_path / "lmdb", half_life=100.0, clock=clock)
    try:
        assert reopened.entry(chunks[0].key) == before[chunks[0].key]
        assert reopened.entry(chunks[2].key).frequency == before[chunks[2].key].frequency + 1
    finally:
        reopened.close()


def test_reopening_with_a_smaller_budget_evicts_down_to_it(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "lmdb", max_bytes=10_000)
    put(cache, *[make_chunk(i, 2000) for i in range(5)])
    cache.close()
    smaller = open_cache(tmp_path / "lmdb", max_bytes=5000)
    try:
        assert smaller.stats().num_bytes == 4000
    finally:
        smaller.close()


def test_lookup_reports_the_prefix_run_and_counts_hits(cache: ChunkCache) -> None:
    a, b, c = make_chunk("a"), make_chunk("b"), make_chunk("c")
    put(cache, a, c)
    result = cache.lookup(NAMESPACE, [a.key, b.key, c.key], [])
    assert (result.prefix_hit, result.prefix_run, result.content_hits) == ([True, False, True], 1, [])
    # Only the leading run counts toward frequencies.
    assert cache.stats().num_unflushed_hits == 1
    assert (cache.stats().counters.hits, cache.stats().counters.misses) == (2, 1)
    assert cache.lookup(OTHER_NAMESPACE, [a.key], []).prefix_run == 0, "keys of another namespace never hit"


def test_content_keys_find_chunks_stored_under_another_prefix(cache: ChunkCache) -> None:
    document = digest("document tokens")
    stored = make_chunk("doc in context 1", content_key=document)
    other = make_chunk("other tokens", content_key=digest("other"))
    put(cache, stored, other)
    missing_prefix = make_chunk("doc in context 2")
    result = cache.lookup(NAMESPACE, [stored.key, missing_prefix.key, make_chunk("z").key],
                          [b"", document, digest("never stored")])
    assert result.prefix_hit == [True, False, False]
    assert result.content_hits == [(1, stored.key)]
    assert cache.lookup(OTHER_NAMESPACE, [missing_prefix.key], [document]).content_hits == []


def test_content_hit_prefers_the_chunk_kept_most_reliably(cache: ChunkCache) -> None:
    document = digest("document tokens")
    cold, hot = make_chunk("cold", content_key=document), make_chunk("hot", content_key=document)
    put(cache, cold, hot)
    cache.lookup(NAMESPACE, [hot.key], [])
    cache.flush_hits()
    assert cache.lookup(NAMESPACE, [digest("new context")], [document]).content_hits == [(0, hot.key)]


def test_delete_by_keys_and_by_namespace(cache: ChunkCache) -> None:
    a, b = make_chunk("a", 100), make_chunk("b", 200)
    c = make_chunk("c", 300, namespace=OTHER_NAMESPACE)
    put(cache, a, b, c)
    result = cache.delete_keys([a.key, digest("absent")])
    assert (result.deleted, result.bytes_freed) == (1, 100)
    result = cache.delete_namespace(OTHER_NAMESPACE)
    assert (result.deleted, result.bytes_freed) == (1, 300)
    with pytest.raises(NotFound):
        cache.delete_namespace(OTHER_NAMESPACE)
    assert cache.stats().num_entries == 1


def flip_byte(data_dir: Path, key: bytes, offset: int = 10) -> None:
    """Corrupts a stored blob behind the cache's back, straight in LMDB."""
    with lmdb.open(str(data_dir), max_dbs=3) as env:
        blobs = env.open_db(BLOBS_DB)
        with env.begin(write=True, db=blobs) as txn:
            blob = bytearray(txn.get(key))
            blob[offset] ^= 0xFF
            txn.put(key, bytes(blob))


def test_a_corrupted_blob_is_deleted_counted_and_served_as_a_miss(tmp_path: Path) -> None:
    good, bad = make_chunk("good"), make_chunk("bad")
    cache = open_cache(tmp_path / "lmdb")
    put(cache, good, bad)
    cache.close()
    flip_byte(tmp_path / "lmdb", bad.key)
    cache = open_cache(tmp_path / "lmdb")
    try:
        assert read_blob(cache, bad) is None
        assert read_blob(cache, good) == good.blob
        stats = cache.stats()
        assert (stats.counters.corrupted, stats.num_entries) == (1, 1)
        assert cache.entry(bad.key) is None
        assert cache.store.read_blob(bad.key, bytes) is None, "the bad blob is gone from LMDB too"
    finally:
        cache.close()
