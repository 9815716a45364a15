"""EventFeed: WatchEvents replies in order, the cursor to resume from, resyncs after `lost`."""
from __future__ import annotations

import pytest

from kvboost.v1 import cache_pb2
from router.event_feed import NO_CURSOR, Cursor, EventFeed, EventGap
from tests.router.factories import event, events, key, lost, snapshot


def synced_feed(*prefixes: str) -> EventFeed:
    """A feed after `lost` at sequence 10 and a one-page snapshot of `prefixes`."""
    feed = EventFeed()
    feed.receive(lost(10))
    feed.receive(snapshot(*prefixes))
    return feed


def test_lost_then_snapshot_then_events_from_the_resume_sequence():
    feed = EventFeed()
    assert feed.cursor == NO_CURSOR and not feed.live
    feed.receive(lost(10))
    feed.receive(snapshot("a", last=False))
    assert not feed.live and feed.cursor == NO_CURSOR  # mid-snapshot there is nothing to resume
    feed.receive(snapshot("b"))
    assert feed.live and feed.cursor == Cursor("inc-1", 10)
    feed.receive(events(event(10, prefix="c"), event(11, cache_pb2.KV_EVENT_EVICTED, "a")))
    assert feed.cursor == Cursor("inc-1", 12)
    assert [feed.holdings.holds_prefix(key(name)) for name in "abc"] == [False, True, True]
    assert (feed.num_events, feed.num_resyncs) == (2, 1)


def test_old_holdings_answer_until_the_snapshot_completes():
    feed = synced_feed("a")
    feed.receive(lost(50, incarnation="inc-2", reason="cursor behind history"))
    feed.receive(snapshot("b", last=False, incarnation="inc-2"))
    assert feed.holdings.holds_prefix(key("a")) and not feed.holdings.holds_prefix(key("b"))
    feed.receive(snapshot("c", incarnation="inc-2"))
    assert [feed.holdings.holds_prefix(key(name)) for name in "abc"] == [False, True, True]
    assert feed.cursor == Cursor("inc-2", 50) and feed.num_resyncs == 2


def test_a_key_in_the_snapshot_and_again_as_an_event_is_held_once():
    feed = synced_feed("a")
    feed.receive(events(event(10, prefix="a")))
    feed.receive(events(event(11, cache_pb2.KV_EVENT_EVICTED, "a")))
    assert not feed.holdings.holds_prefix(key("a"))


def test_repeated_events_of_a_resumed_stream_are_skipped():
    feed = synced_feed()
    feed.receive(events(event(10, prefix="a")))
    feed.receive(events(event(10, prefix="a"), event(11, prefix="b")))
    assert feed.num_events == 2 and feed.cursor.next_sequence == 12


def test_a_gap_or_a_silent_new_incarnation_is_refused():
    feed = synced_feed()
    with pytest.raises(EventGap, match="expected event 10, got 12"):
        feed.receive(events(event(12, prefix="a")))
    with pytest.raises(EventGap, match="incarnation changed"):
        feed.receive(events(event(10, prefix="a"), incarnation="inc-9"))
    assert feed.cursor == Cursor("inc-1", 10)  # nothing applied: resume where it was


def test_events_before_any_snapshot_and_pages_without_lost_are_refused():
    with pytest.raises(EventGap, match="before the snapshot"):
        EventFeed().receive(events(event(0, prefix="a")))
    with pytest.raises(EventGap, match="without `lost`"):
        EventFeed().receive(snapshot("a"))


def test_a_stream_broken_mid_snapshot_asks_for_a_whole_one_next_time():
    feed = synced_feed("a")
    feed.receive(lost(20, incarnation="inc-2"))
    feed.receive(snapshot("b", last=False, incarnation="inc-2"))
    feed.interrupted()
    assert feed.cursor == NO_CURSOR
    assert feed.holdings.holds_prefix(key("a"))  # what was known stays until a snapshot replaces it


def test_a_stream_broken_while_live_resumes_from_the_cursor():
    feed = synced_feed()
    feed.receive(events(event(10, prefix="a")))
    feed.interrupted()
    assert feed.cursor == Cursor("inc-1", 11)
