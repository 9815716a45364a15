"""Eviction policy: exact orders, decay, admission under a budget."""
from __future__ import annotations

import math

import pytest

from cache_daemon.entry import ChunkKey, Entry
from cache_daemon.eviction import (NO_DECAY, decayed_frequency, eviction_order, plan_admission, record_hits,
                                   retention_score)

NAMESPACE = bytes(32)


def key(index: int) -> ChunkKey:
    return ChunkKey(index.to_bytes(32, "big"))


def make_entry(frequency: float = 1.0, last_access: float = 0.0, size_bytes: int = 1, pinned: bool = False) -> Entry:
    return Entry(namespace=NAMESPACE, content_key=b"", num_tokens=4, size_bytes=size_bytes, checksum=0,
                 frequency=frequency, last_access=last_access, pinned=pinned)


def test_frequency_halves_every_half_life() -> None:
    entry = make_entry(frequency=8.0, last_access=100.0)
    assert decayed_frequency(entry, now=100.0, half_life=10.0) == 8.0
    assert decayed_frequency(entry, now=110.0, half_life=10.0) == 4.0
    assert decayed_frequency(entry, now=130.0, half_life=10.0) == 1.0
    assert decayed_frequency(entry, now=1e9, half_life=NO_DECAY) == 8.0


def test_record_hits_decays_then_adds() -> None:
    entry = make_entry(frequency=4.0, last_access=0.0)
    # 4 halves to 2 over one half-life, then 3 hits arrive at t=10.
    assert record_hits(entry, 3, now=10.0, half_life=10.0) == make_entry(frequency=5.0, last_access=10.0)


def test_order_is_lfu_then_least_recent_then_key_without_decay() -> None:
    entries = {
        key(1): make_entry(frequency=3, last_access=0),
        key(2): make_entry(frequency=1, last_access=5),
        key(3): make_entry(frequency=1, last_access=2),
        key(4): make_entry(frequency=2, last_access=9),
        key(5): make_entry(frequency=1, last_access=2),
        key(6): make_entry(frequency=9, last_access=0, pinned=True),
    }
    # frequency 1 first (last access 2 before 5; keys 3 and 5 tie on both, so by key),
    # then frequency 2, then 3; the pinned chunk never appears.
    assert eviction_order(entries, NO_DECAY) == [key(3), key(5), key(2), key(4), key(1)]


def test_aging_lets_a_recent_chunk_outlive_a_formerly_hot_one() -> None:
    entries = {
        key(1): make_entry(frequency=8, last_access=0),  # hot long ago: 8 -> 1 after 3 half-lives
        key(2): make_entry(frequency=2, last_access=25),  # warm now
        key(3): make_entry(frequency=1, last_access=30),  # one hit just now
        key(4): make_entry(frequency=1, last_access=10),  # one hit a while ago
    }
    # Decayed to t=30: key 1 -> 1.0, key 2 -> 1.41, key 3 -> 1.0, key 4 -> 0.25.
    # Keys 1 and 3 tie at 1.0: key 1 was accessed earlier, so it goes first.
    assert eviction_order(entries, half_life=10.0) == [key(4), key(1), key(3), key(2)]
    # Without decay the old hot chunk would be kept longest.
    assert eviction_order(entries, NO_DECAY) == [key(4), key(3), key(2), key(1)]


def test_retention_score_orders_like_decayed_frequencies_at_any_time() -> None:
    a, b = make_entry(frequency=6, last_access=0), make_entry(frequency=2, last_access=12)
    for now in (12.0, 100.0, 10_000.0):
        by_frequency = decayed_frequency(a, now, 10.0) < decayed_frequency(b, now, 10.0)
        assert by_frequency == (retention_score(a, 10.0) < retention_score(b, 10.0))
    assert retention_score(make_entry(frequency=0), 10.0) == -math.inf


def test_admission_evicts_least_valuable_until_the_new_chunks_fit() -> None:
    entries = {key(i): make_entry(frequency=i, size_bytes=10) for i in range(1, 6)}  # 50 bytes
    plan = plan_admission(entries, [(key(10), 10), (key(11), 15)], max_bytes=60, half_life=NO_DECAY)
    # 50 + 25 = 75 bytes for 60: free 15, that is the two least used chunks (20 bytes).
    assert plan.admitted == [key(10), key(11)]
    assert plan.rejected == []
    assert plan.victims == [key(1), key(2)]
    assert plan.bytes_freed == 20


def test_admission_without_pressure_evicts_nothing() -> None:
    entries = {key(1): make_entry(size_bytes=10)}
    plan = plan_admission(entries, [(key(2), 50)], max_bytes=60, half_life=NO_DECAY)
    assert (plan.admitted, plan.victims) == ([key(2)], [])


def test_pinned_chunks_are_never_victims_and_limit_admission() -> None:
    entries = {
        key(1): make_entry(size_bytes=40, pinned=True),
        key(2): make_entry(frequency=5, size_bytes=10),
    }
    # Room beside the pinned 40 bytes is 60: the first two incoming fit (50), the third would
    # not, so it and everything after it are rejected (a prefix chain is kept from its start).
    plan = plan_admission(entries, [(key(3), 30), (key(4), 20), (key(5), 20), (key(6), 1)], max_bytes=100,
                          half_life=NO_DECAY)
    assert plan.admitted == [key(3), key(4)]
    assert plan.rejected == [key(5), key(6)]
    assert plan.victims == []  # 40 + 10 + 50 = 100 fits exactly


@pytest.mark.parametrize("half_life", [NO_DECAY, 50.0])
def test_a_chunk_read_on_every_request_outlives_1000_one_off_chunks(half_life: float) -> None:
    budget_chunks = 100
    entries: dict[ChunkKey, Entry] = {}
    hot = key(0)
    for request in range(1000):
        now = float(request)
        # Every request reads the hot chunk (a system prompt), then stores one new chunk.
        if hot in entries:
            entries[hot] = record_hits(entries[hot], 1, now, half_life)
        incoming = [(hot, 1)] if hot not in entries else []
        incoming.append((key(request + 1), 1))
        plan = plan_admission(entries, incoming, max_bytes=budget_chunks, half_life=half_life)
        for victim in plan.victims:
            del entries[victim]
        for new_key in plan.admitted:
            entries[new_key] = make_entry(frequency=1.0, last_access=now)
        assert len(entries) <= budget_chunks
    # The hot chunk stayed from the first request on; of the one-off chunks only the 99 newest
    # remain, and they leave oldest first.
    assert entries[hot].last_access == 999.0
    assert sorted(entries) == sorted([hot] + [key(i) for i in range(902, 1001)])
    assert eviction_order(entries, half_life)[:3] == [key(902), key(903), key(904)]
    assert eviction_order(entries, half_life)[-1] == hot
