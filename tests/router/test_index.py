"""DaemonHoldings: what each KV event does to the index of one daemon's L1."""
from __future__ import annotations

from kvboost.v1 import cache_pb2
from router.index import DaemonHoldings
from tests.router.factories import event, key, snapshot

STORED, PROMOTED, EVICTED = cache_pb2.KV_EVENT_STORED, cache_pb2.KV_EVENT_PROMOTED, cache_pb2.KV_EVENT_EVICTED
DELETED, CLEARED = cache_pb2.KV_EVENT_DELETED, cache_pb2.KV_EVENT_CLEARED


def test_stored_and_promoted_chunks_are_held_evicted_and_deleted_ones_not():
    holdings = DaemonHoldings()
    holdings.apply(event(0, STORED, "a", content="ca"))
    holdings.apply(event(1, PROMOTED, "b"))
    assert holdings.holds_prefix(key("a")) and holdings.holds_prefix(key("b"))
    assert holdings.holds_content(key("ca")) and not holdings.holds_content(key("b"))
    holdings.apply(event(2, EVICTED, "a"))
    holdings.apply(event(3, DELETED, "b"))
    assert not holdings.holds_prefix(key("a")) and not holdings.holds_prefix(key("b"))
    # The content key went with the only chunk that carried it.
    assert not holdings.holds_content(key("ca")) and holdings.num_chunks == 0


def test_a_content_key_stays_while_any_chunk_carries_it():
    # The same document in two contexts: two prefix keys, one content key.
    holdings = DaemonHoldings()
    holdings.apply(event(0, STORED, "doc-after-x", content="doc"))
    holdings.apply(event(1, STORED, "doc-after-y", content="doc"))
    holdings.apply(event(2, EVICTED, "doc-after-x"))
    assert holdings.holds_content(key("doc"))
    holdings.apply(event(3, EVICTED, "doc-after-y"))
    assert not holdings.holds_content(key("doc"))


def test_a_chunk_stored_again_keeps_one_count_of_its_content_key():
    holdings = DaemonHoldings()
    holdings.apply(event(0, STORED, "a", content="ca"))
    holdings.apply(event(1, STORED, "a", content="ca"))
    holdings.apply(event(2, EVICTED, "a"))
    assert not holdings.holds_content(key("ca"))


def test_cleared_removes_one_namespace_of_one_tenant():
    other_namespace = bytes([1]) * 32
    holdings = DaemonHoldings()
    holdings.apply(event(0, STORED, "a", tenant="alice"))
    holdings.apply(event(1, STORED, "b", tenant="alice", namespace=other_namespace))
    holdings.apply(event(2, STORED, "c", tenant="bob"))
    holdings.apply(event(3, CLEARED, tenant="alice"))
    assert not holdings.holds_prefix(key("a"))
    assert holdings.holds_prefix(key("b")) and holdings.holds_prefix(key("c"))


def test_lookups_by_tenant_see_that_tenant_only():
    holdings = DaemonHoldings()
    holdings.apply(event(0, STORED, "a", content="ca", tenant="alice"))
    assert holdings.holds_prefix(key("a"), "alice") and holdings.holds_content(key("ca"), "alice")
    assert not holdings.holds_prefix(key("a"), "bob") and not holdings.holds_content(key("ca"), "bob")
    assert holdings.holds_prefix(key("a"))  # None: any tenant


def test_l2_events_leave_the_l1_index_alone():
    holdings = DaemonHoldings()
    holdings.apply(event(0, STORED, "a", tier=cache_pb2.KV_TIER_L2))
    assert not holdings.holds_prefix(key("a"))
    holdings.apply(event(1, STORED, "b"))
    holdings.apply(event(2, EVICTED, "b", tier=cache_pb2.KV_TIER_L2))
    assert holdings.holds_prefix(key("b"))


def test_a_snapshot_replaces_everything_held_before():
    holdings = DaemonHoldings()
    holdings.apply(event(0, STORED, "old"))
    fresh = DaemonHoldings()
    fresh.add_snapshot(snapshot("new", content={"new": "cnew"}).snapshot.entries)
    holdings.replace_with(fresh)
    assert not holdings.holds_prefix(key("old"))
    assert holdings.holds_prefix(key("new")) and holdings.holds_content(key("cnew"))
