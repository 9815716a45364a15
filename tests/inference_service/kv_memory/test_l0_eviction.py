"""L0's eviction order: leaves of the prefix tree first, then the daemon's LFU with decay; exact orders asserted."""
from __future__ import annotations

from inference_service.kv_memory.l0_eviction import L0Entry, eviction_order, plan_admission, record_hit

HALF_LIFE = 10.0


def chain(*names: bytes, start: float = 0.0, parent: bytes | None = None) -> dict[bytes, L0Entry]:
    """A prompt's chunks in order (the first one a root), each chaining from the one before, one second apart."""
    entries = {}
    for offset, name in enumerate(names):
        entries[name] = L0Entry(1, parent, 1.0, start + offset)
        parent = name
    return entries


def test_a_chain_leaves_from_its_last_chunk_although_its_head_is_the_oldest():
    entries = chain(b"a0", b"a1", b"a2", b"a3")
    assert eviction_order(entries, HALF_LIFE) == [b"a3", b"a2", b"a1", b"a0"]


def test_leaves_of_two_prompts_go_by_recency_and_a_parent_waits_for_all_its_children():
    entries = {**chain(b"a0", b"a1", b"a2"), **chain(b"b0", b"b1", start=5.0)}
    entries[b"a1x"] = L0Entry(1, b"a0", 1.0, 3.0)  # a second branch after a0 (another question on one document)
    # Leaves a2 (t=2), a1x (t=3), b1 (t=6): a2 first; then a1 (t=1) is a leaf and the oldest; a0 waits for a1x.
    assert eviction_order(entries, HALF_LIFE) == [b"a2", b"a1", b"a1x", b"a0", b"b1", b"b0"]


def test_frequency_outweighs_recency_until_it_decays():
    entries = {**chain(b"a0", start=0.0), **chain(b"b0", start=5.0)}
    hit_twice = record_hit(record_hit(entries[b"a0"], 1.0, HALF_LIFE), 2.0, HALF_LIFE)
    assert eviction_order({**entries, b"a0": hit_twice}, HALF_LIFE) == [b"b0", b"a0"]  # ~3 hits at t=2 beat 1 at t=5
    stale = record_hit(entries[b"a0"], 1.0, HALF_LIFE)  # ~2 hits at t=1: 1 hit at t=15 is worth more
    assert eviction_order({b"a0": stale, b"b0": L0Entry(1, None, 1.0, 15.0)}, HALF_LIFE) == [b"a0", b"b0"]


def test_a_kept_key_is_never_yielded_and_keeps_its_ancestors():
    entries = {**chain(b"a0", b"a1", b"a2"), **chain(b"b0", start=5.0)}
    assert eviction_order(entries, HALF_LIFE, keep=frozenset((b"a2",))) == [b"b0"]


def test_admission_evicts_other_prompts_leaves_but_never_the_incomings_own_prefix():
    entries = {**chain(b"b0", b"b1"), **chain(b"a0", b"a1", start=5.0)}
    # Room for 4: a2 (child of a1) evicts b's last chunk, not a1, although a1 is a leaf before a2 enters.
    assert plan_admission(entries, b"a2", L0Entry(1, b"a1", 1.0, 9.0), 4, HALF_LIFE) == [b"b1"]
    assert plan_admission(entries, b"a2", L0Entry(2, b"a1", 1.0, 9.0), 4, HALF_LIFE) == [b"b1", b"b0"]
    # Only a's own chunks are left: a3 is not kept, and nothing is evicted for it (the prompt keeps its head).
    only_a = chain(b"a0", b"a1", b"a2", b"a3")
    assert plan_admission(only_a, b"a4", L0Entry(1, b"a3", 1.0, 9.0), 4, HALF_LIFE) is None
    assert plan_admission(only_a, b"x", L0Entry(5, None, 1.0, 9.0), 4, HALF_LIFE) is None  # larger than the tier
    assert plan_admission(only_a, b"x", L0Entry(1, None, 1.0, 9.0), 5, HALF_LIFE) == []  # fits as it is


def test_an_orphan_leaves_first_and_nothing_is_evicted_for_one():
    entries = {**chain(b"a0", b"a1"), b"c5": L0Entry(1, b"c4", 9.0, 9.0)}  # c4 left (or never came): c5 is unplaceable
    assert eviction_order(entries, HALF_LIFE) == [b"c5", b"a1", b"a0"]
    assert plan_admission(chain(b"a0", b"a1"), b"c6", L0Entry(1, b"c5", 1.0, 9.0), 2, HALF_LIFE) is None
    assert plan_admission(chain(b"a0", b"a1"), b"c6", L0Entry(1, b"c5", 1.0, 9.0), 3, HALF_LIFE) == []  # room: kept
