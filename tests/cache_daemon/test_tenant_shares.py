"""Per-tenant budgets: each tenant's share of the eviction index, and a Store over a share evicting only its own chunks."""
from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest

from cache_daemon.cache import ChunkCache
from cache_daemon.entry import ChunkKey, Entry
from cache_daemon.errors import BudgetExceeded
from cache_daemon.eviction import NO_DECAY, eviction_order
from cache_daemon.index import EntryIndex
from cache_daemon.store import LmdbStore
from tests.cache_daemon.test_cache import FakeClock, incoming, read_blob
from tests.daemon_support import digest, make_chunk

ALICE_NS, BOB_NS, FREE_NS = digest("alice's namespace"), digest("bob's namespace"), digest("nobody's namespace")


def open_cache(path: Path, max_bytes: int = 20_000, shares=None) -> ChunkCache:
    shares = {"alice": 6_000, "bob": 6_000} if shares is None else shares
    cache = ChunkCache(LmdbStore(path, map_size=1 << 22), max_bytes, math.inf, clock=FakeClock(),
                       share_budgets=shares)
    cache.record_owners({ALICE_NS: "alice", BOB_NS: "bob"})
    return cache


def chunks_of(tenant: str, namespace: bytes, count: int, size: int = 1000, start: int = 0):
    return [make_chunk(f"{tenant} {index}", size, namespace=namespace) for index in range(start, start + count)]


def put(cache: ChunkCache, chunks):
    """One Store; its chunks are last accessed one second after the previous Store's, so older ones go first."""
    cache._clock.now += 1
    return cache.put_many([incoming(chunk) for chunk in chunks])


def put_one_by_one(cache: ChunkCache, chunks) -> None:
    for chunk in chunks:
        assert put(cache, [chunk]).stored == 1


def held(cache: ChunkCache, chunks) -> list[bool]:
    return [read_blob(cache, chunk) is not None for chunk in chunks]


def test_a_tenant_over_its_share_evicts_its_own_least_used_chunks_never_anothers(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "lmdb")
    try:
        alice = chunks_of("alice", ALICE_NS, 4)
        assert put(cache, alice).stored == 4
        bob = chunks_of("bob", BOB_NS, 6)
        put_one_by_one(cache, bob)  # bob's share is full: 6 x 1000 bytes of 6000
        # bob reads his chunk 0 and 2 often: chunks 1, 3, 4 are his least used, in that order.
        for _ in range(3):
            cache.lookup(BOB_NS, [bob[0].key], [])
            cache.lookup(BOB_NS, [bob[2].key], [])
        cache.flush_hits()
        more = chunks_of("bob", BOB_NS, 3, start=6)
        result = put(cache, more)
        assert (result.stored, result.evicted) == (3, 3)
        assert held(cache, bob + more) == [True, False, True, False, False, True, True, True, True]
        assert held(cache, alice) == [True] * 4, "bob filling his share evicts none of alice's chunks"
        assert cache.share_usage("bob") == (6000, 6000)
        assert cache.share_usage("alice") == (4000, 6000)
        assert cache.share_usage("carol") is None
        assert cache.stats().num_bytes == 10_000
    finally:
        cache.close()


def test_the_global_budget_still_applies_across_tenants(tmp_path: Path) -> None:
    # Shares that add up to more than --max-bytes are not guarantees: the global LFU order decides.
    cache = open_cache(tmp_path / "lmdb", max_bytes=8_000)
    try:
        alice = chunks_of("alice", ALICE_NS, 5)
        put_one_by_one(cache, alice)
        put(cache, chunks_of("free", FREE_NS, 2))  # nobody's: only the global budget counts it
        result = put(cache, chunks_of("bob", BOB_NS, 3))
        assert result.stored == 3 and cache.stats().num_bytes == 8_000
        assert sum(held(cache, alice)) == 3, "the global budget evicted the oldest chunks, alice's first two"
        assert cache.share_usage("alice") == (3000, 6000)
    finally:
        cache.close()


def test_a_share_full_of_pinned_chunks_refuses_the_tenant_only(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "lmdb", shares={"bob": 2_000})
    try:
        put(cache, [dataclasses.replace(chunk, pinned=True) for chunk in chunks_of("bob", BOB_NS, 2)])
        with pytest.raises(BudgetExceeded, match="tenant bob's share max_bytes=2000"):
            put(cache, chunks_of("bob", BOB_NS, 1, start=2))
        assert put(cache, chunks_of("alice", ALICE_NS, 5)).stored == 5, "alice has no share: the global budget"
        with pytest.raises(BudgetExceeded, match="tenant bob's share"):
            put(cache, [make_chunk("too big for bob's share", 3_000, namespace=BOB_NS)])
    finally:
        cache.close()


def test_shares_are_rebuilt_at_open_and_a_smaller_share_evicts_down_to_it(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "lmdb")
    alice, bob = chunks_of("alice", ALICE_NS, 5), chunks_of("bob", BOB_NS, 5)
    put(cache, alice)
    put_one_by_one(cache, bob)
    cache.close()

    cache = open_cache(tmp_path / "lmdb", shares={"alice": 6_000, "bob": 3_000})
    try:
        assert cache.share_usage("alice") == (5000, 6000), "owners come back from LMDB with the chunks"
        assert cache.share_usage("bob") == (3000, 3000), "reopening with a smaller share evicts bob down to it"
        assert held(cache, alice) == [True] * 5
        assert held(cache, bob) == [False, False, True, True, True]
        # Over his share again after the restart: bob's own oldest go, through the rebuilt heap.
        put(cache, chunks_of("bob", BOB_NS, 1, start=5))
        assert held(cache, bob) == [False, False, False, True, True]
        assert held(cache, alice) == [True] * 5
    finally:
        cache.close()


def test_chunks_stored_before_their_namespace_had_an_owner_join_the_share(tmp_path: Path) -> None:
    cache = ChunkCache(LmdbStore(tmp_path / "lmdb", map_size=1 << 22), 20_000, math.inf, clock=FakeClock(),
                       share_budgets={"bob": 3_000})
    try:
        bob = chunks_of("bob", BOB_NS, 3)
        put_one_by_one(cache, bob)  # before tenancy (or by an admin): no owner yet
        assert cache.share_usage("bob") == (0, 3000)
        cache.record_owners({BOB_NS: "bob"})
        assert cache.share_usage("bob") == (3000, 3000)
        put(cache, chunks_of("bob", BOB_NS, 1, start=3))
        assert held(cache, bob) == [False, True, True]
    finally:
        cache.close()


def key(index: int) -> ChunkKey:
    return ChunkKey(digest(f"key {index}"))


@pytest.mark.parametrize("seed", range(4))
def test_each_share_heap_is_the_exact_order_of_its_tenants_entries(seed: int) -> None:
    rng = random.Random(seed)
    namespaces = [ALICE_NS, BOB_NS, FREE_NS]
    index, entries = EntryIndex(NO_DECAY, {"alice": 100, "bob": 100}), {}
    index.assign_owner(ALICE_NS, "alice")
    index.assign_owner(BOB_NS, "bob")
    for step in range(300):
        action = rng.random()
        if action < 0.5 or not entries:
            slot = index.reserve_slots(1)[0]
            entries[key(step)] = Entry(namespace=rng.choice(namespaces), content_key=b"", num_tokens=4,
                                       size_bytes=rng.randint(1, 9), checksum=0,
                                       frequency=float(rng.choice([0, 1, 2, 8])), last_access=float(rng.randint(0, 5)),
                                       pinned=rng.random() < 0.15, slot=slot)
            index.add(key(step), entries[key(step)])
        elif action < 0.8:
            old_key = rng.choice(list(entries))
            entries[old_key] = dataclasses.replace(entries[old_key], frequency=float(rng.randint(0, 9)),
                                                   pinned=rng.random() < 0.15)
            index.replace(entries[old_key])
        else:
            index.remove(entries.pop(rng.choice(list(entries))).slot)
    for tenant, namespace in (("alice", ALICE_NS), ("bob", BOB_NS)):
        share = index.shares[tenant]
        mine = {k: entry for k, entry in entries.items() if entry.namespace == namespace}
        assert [index.key_of(slot) for slot, _ in index.iter_victims(share)] == eviction_order(mine, NO_DECAY)
        assert share.num_bytes == sum(entry.size_bytes for entry in mine.values())
        assert share.pinned_bytes == sum(entry.size_bytes for entry in mine.values() if entry.pinned)
