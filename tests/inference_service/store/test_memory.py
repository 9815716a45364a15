"""InMemoryStore and NullStore against the ChunkStore contract."""
from __future__ import annotations

import threading

from inference_service.store.memory import InMemoryStore
from inference_service.store.protocol import StoreLookup, NullStore, StoreItem

NAMESPACE = b"n" * 32


def make_item(index: int, namespace: bytes = NAMESPACE, content: bool = False, **fields) -> StoreItem:
    key = bytes([index]) * 32
    return StoreItem(key=key, namespace=namespace, content_key=bytes([100 + index]) * 32 if content else None,
                     num_tokens=8, blob=b"blob%d" % index, **fields)


def keys(*indices: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in indices]


def epoch_of(cache: InMemoryStore):
    return cache.lookup(NAMESPACE, []).delete_epoch


def test_a_delete_moves_the_delete_epoch_on_and_an_eviction_does_not():
    cache = InMemoryStore()
    cache.store([make_item(0), make_item(1)])
    first = epoch_of(cache)
    cache.evict(keys(0))  # as the daemon's budget would
    assert epoch_of(cache) == first and cache.lookup(NAMESPACE, keys(0)).prefix_run == 0
    cache.delete(keys(1))  # as the daemon's Delete would
    assert epoch_of(cache).count == first.count + 1 and epoch_of(cache).id == first.id
    assert epoch_of(InMemoryStore()).id != first.id  # another store (a daemon's other start): another id


def test_lookup_counts_the_leading_run_only():
    cache = InMemoryStore()
    cache.store([make_item(0), make_item(1), make_item(3)])
    # 0 and 1 hit, 2 misses: the run stops there even though 3 is stored.
    assert cache.lookup(NAMESPACE, keys(0, 1, 2, 3)) == StoreLookup(2, {}, delete_epoch=epoch_of(cache))
    assert cache.lookup(NAMESPACE, keys(2, 0)).prefix_run == 0
    assert cache.lookup(NAMESPACE, []).prefix_run == 0


def test_lookup_ignores_entries_of_another_namespace():
    cache = InMemoryStore()
    cache.store([make_item(0, namespace=b"m" * 32)])
    assert cache.lookup(NAMESPACE, keys(0)).prefix_run == 0


def test_content_hits_after_the_prefix_run_name_the_stored_prefix_key():
    cache = InMemoryStore()
    cache.store([make_item(0, content=True), make_item(5, content=True)])
    content_keys = [bytes([100]) * 32, bytes([105]) * 32, bytes([106]) * 32]
    # Chunk 0 is a prefix hit (not reported again), chunk 1's content matches item 5, chunk 2 nothing.
    result = cache.lookup(NAMESPACE, keys(0, 9, 10), content_keys)
    assert result == StoreLookup(1, {1: keys(5)[0]}, delete_epoch=epoch_of(cache))


def test_fetch_keeps_the_order_and_reports_misses():
    cache = InMemoryStore()
    cache.store([make_item(0), make_item(1)])
    assert [(k, None if b is None else bytes(b)) for k, b in cache.fetch(keys(1, 7, 0))] == [
        (keys(1)[0], b"blob1"), (keys(7)[0], None), (keys(0)[0], b"blob0")]


def test_fetched_blobs_are_writable_so_decoding_can_share_them():
    cache = InMemoryStore()
    cache.store([make_item(0)])
    [(_, blob)] = list(cache.fetch(keys(0)))
    assert isinstance(blob, bytearray)


def test_store_counts_and_overwrites():
    cache = InMemoryStore()
    assert cache.store([make_item(0), make_item(1)]) == 2
    assert cache.store([make_item(0, pin=True)]) == 1
    assert len(cache) == 2 and cache._entries[keys(0)[0]].pin
    cache.delete(keys(0))
    assert cache.lookup(NAMESPACE, keys(0, 1)).prefix_run == 0


def test_concurrent_stores_and_lookups():
    cache = InMemoryStore()

    def writer(offset: int) -> None:
        for i in range(offset, offset + 50):
            cache.store([make_item(i)])
            cache.lookup(NAMESPACE, keys(*range(i + 1)))

    threads = [threading.Thread(target=writer, args=(offset,)) for offset in (0, 50, 100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(cache) == 150 and cache.lookup(NAMESPACE, keys(*range(150))).prefix_run == 150


def test_null_cache_never_hits():
    cache = NullStore()
    assert cache.store([make_item(0)]) == 0
    assert cache.lookup(NAMESPACE, keys(0)) == StoreLookup(0, {})
    assert list(cache.fetch(keys(0))) == [(keys(0)[0], None)]
    assert cache.degraded is False
