"""The daemon's incremental eviction (index + heap) against the exact reference in eviction.py."""
from __future__ import annotations

import dataclasses
import math
import random
import struct
from pathlib import Path

import lmdb
import pytest

from cache_daemon.cache import ChunkCache
from cache_daemon.entry import ChunkKey, Entry
from cache_daemon.eviction import NO_DECAY, eviction_order, plan_admission, plan_admission_from_totals
from cache_daemon.index import EntryIndex
from cache_daemon.store import META_DB, LmdbStore, decode_entry
from tests.cache_daemon.test_cache import incoming
from tests.daemon_support import NAMESPACE, digest, make_chunk

OTHER_NAMESPACE = digest("another model")


def key(index: int) -> ChunkKey:
    return ChunkKey(index.to_bytes(32, "big"))


def random_entry(rng: random.Random, slot: int) -> Entry:
    # Few distinct frequencies and times, so ties on score and on last access are common.
    return Entry(namespace=rng.choice([NAMESPACE, OTHER_NAMESPACE]), content_key=b"", num_tokens=4,
                 size_bytes=rng.randint(1, 9), checksum=0, frequency=float(rng.choice([0, 1, 1, 2, 3, 8])),
                 last_access=float(rng.randint(0, 5)), pinned=rng.random() < 0.1, slot=slot)


def index_order(index: EntryIndex) -> list[ChunkKey]:
    return [index.key_of(slot) for slot, _ in index.iter_victims()]


@pytest.mark.parametrize("half_life", [NO_DECAY, 2.0])
@pytest.mark.parametrize("seed", range(5))
def test_heap_order_is_the_exact_order_through_adds_updates_pins_and_removes(half_life: float, seed: int) -> None:
    rng = random.Random(seed)
    index, entries = EntryIndex(half_life), {}
    for step in range(400):
        action = rng.random()
        if action < 0.5 or not entries:  # add
            new_key = key(step)
            entries[new_key] = random_entry(rng, index.reserve_slots(1)[0])
            index.add(new_key, entries[new_key])
        elif action < 0.8:  # hits or a pin change rewrite the entry in place
            old_key = rng.choice(list(entries))
            entries[old_key] = dataclasses.replace(random_entry(rng, entries[old_key].slot),
                                                   namespace=entries[old_key].namespace,
                                                   size_bytes=entries[old_key].size_bytes)
            index.replace(entries[old_key])
        else:  # remove; the slot is reused by a later add
            old_key = rng.choice(list(entries))
            index.remove(entries.pop(old_key).slot)
        if step % 40 == 39:
            assert index_order(index) == eviction_order(entries, half_life)
    assert index.num_bytes == sum(entry.size_bytes for entry in entries.values())
    assert index.pinned_bytes == sum(entry.size_bytes for entry in entries.values() if entry.pinned)
    assert {ns: (u.num_entries, u.num_bytes, u.num_pinned) for ns, u in index.usage().items()} == {
        ns: (sum(1 for e in entries.values() if e.namespace == ns),
             sum(e.size_bytes for e in entries.values() if e.namespace == ns),
             sum(e.pinned for e in entries.values() if e.namespace == ns))
        for ns in {e.namespace for e in entries.values()}}
    assert index.capacity < len(entries) + 1100, "freed slots are reused"


@pytest.mark.parametrize("seed", range(5))
def test_plans_from_counters_and_heap_equal_the_reference_plans(seed: int) -> None:
    rng = random.Random(seed)
    index, entries = EntryIndex(NO_DECAY), {}
    for number in range(60):
        entries[key(number)] = random_entry(rng, index.reserve_slots(1)[0])
        index.add(key(number), entries[key(number)])
    for trial in range(20):
        incoming_chunks = [(key(1000 + trial * 10 + i), rng.randint(1, 30)) for i in range(rng.randint(0, 4))]
        max_bytes = rng.randint(100, 400)
        expected = plan_admission(entries, incoming_chunks, max_bytes, NO_DECAY)
        plan = plan_admission_from_totals(index.num_bytes, index.pinned_bytes, index.iter_victims(), incoming_chunks,
                                          max_bytes)
        assert (plan.admitted, plan.rejected, plan.bytes_freed) == (expected.admitted, expected.rejected,
                                                                    expected.bytes_freed)
        assert [index.key_of(slot) for slot in plan.victims] == expected.victims


def test_iterating_victims_reads_only_as_far_as_needed() -> None:
    index = EntryIndex(NO_DECAY)
    for number in range(1000):
        index.add(key(number), random_entry(random.Random(number), index.reserve_slots(1)[0]))
    victims = index.iter_victims()
    first = [next(victims) for _ in range(3)]
    # The heap is not changed by looking: the same three come first again.
    assert [slot for slot, _ in first] == [slot for slot, _ in list(index.iter_victims())[:3]]


def test_a_cache_reopened_from_lmdb_loads_the_same_index(tmp_path: Path) -> None:
    clock_now = [1000.0]
    cache = ChunkCache(LmdbStore(tmp_path / "lmdb", map_size=1 << 22), 60_000, 50.0, clock=lambda: clock_now[0])
    chunks = [make_chunk(f"c{i}", 500 + i, namespace=NAMESPACE if i % 3 else OTHER_NAMESPACE,
                         pinned=i % 17 == 0) for i in range(150)]
    for start in range(0, len(chunks), 7):
        clock_now[0] += 1
        cache.put_many([incoming(chunk) for chunk in chunks[start:start + 7]])
        cache.lookup(NAMESPACE, [chunk.key for chunk in chunks[start // 2:start // 2 + 3]], [])
        cache.flush_hits()
    before = (index_order(cache._index), cache.stats())
    cache.close()
    store = LmdbStore(tmp_path / "lmdb", map_size=1 << 22)
    store.scan_meta = lambda batch_size=8192, scan=store.scan_meta: scan(batch_size=16)  # many batches
    reopened = ChunkCache(store, 60_000, 50.0, clock=lambda: clock_now[0])
    try:
        stats = reopened.stats()
        assert index_order(reopened._index) == before[0]
        assert (stats.num_entries, stats.num_bytes, stats.namespaces) == (before[1].num_entries, before[1].num_bytes,
                                                                          before[1].namespaces)
        assert before[1].num_bytes <= 60_000 and before[1].counters.evictions > 0
    finally:
        reopened.close()


def test_background_load_serves_reads_and_writers_wait_for_it(tmp_path: Path) -> None:
    chunks = [make_chunk(f"bg{i}", 100) for i in range(20)]
    first = ChunkCache(LmdbStore(tmp_path / "lmdb", map_size=1 << 22), 10_000, math.inf)
    first.put_many([incoming(chunk) for chunk in chunks])
    first.close()
    cache = ChunkCache(LmdbStore(tmp_path / "lmdb", map_size=1 << 22), 10_000, math.inf, load_in_background=True)
    try:
        assert cache.lookup(NAMESPACE, [chunk.key for chunk in chunks], []).prefix_run == 20
        result = cache.put_many([incoming(make_chunk("after restart", 100))])  # waits for the load
        assert cache.wait_until_loaded(0) and result.stored == 1
        assert (cache.stats().num_entries, cache.stats().num_bytes) == (21, 2100)
    finally:
        cache.close()


def test_metadata_written_without_slots_gets_them_on_open(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=4, map_size=1 << 22)
    meta = env.open_db(META_DB)
    with env.begin(write=True, db=meta) as txn:
        for number in range(5):  # version 1: no slot field
            txn.put(digest(number), struct.pack("<BQIddBI32s", 1, 10, 0, 1.0, float(number), 0, 4, NAMESPACE))
    env.close()
    store = LmdbStore(tmp_path / "lmdb", map_size=1 << 22)
    try:
        entries = store.load_entries()
        assert sorted(entry.slot for entry in entries.values()) == [0, 1, 2, 3, 4]
        assert decode_entry(struct.pack("<BQIddBI32s", 1, 10, 0, 1.0, 2.0, 0, 4, NAMESPACE)).slot == -1
    finally:
        store.close()
    cache = ChunkCache(LmdbStore(tmp_path / "lmdb", map_size=1 << 22), 40, math.inf)
    try:  # the 5 x 10 bytes exceed the new budget of 40: the least recent goes at once
        assert (cache.stats().num_entries, cache.entry(ChunkKey(digest(0)))) == (4, None)
    finally:
        cache.close()
