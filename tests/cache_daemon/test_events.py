"""cache_daemon.events: the journal's sequences, its bounded history, lost watchers, tenants' logs; no I/O."""
from __future__ import annotations

import threading

import pytest

from cache_daemon.events import (AHEAD_OF_HISTORY, BEHIND_HISTORY, NEW_INCARNATION, TOO_SLOW, ChunkEvent, EventBatch,
                                 EventJournal, EventKind, Lost)
from tests.daemon_support import NAMESPACE, digest

ALICE_NAMESPACE, BOB_NAMESPACE = digest("alice's namespace"), digest("bob's namespace")


def stored(label: str | int, namespace: bytes = NAMESPACE) -> ChunkEvent:
    return ChunkEvent(EventKind.STORED, namespace, digest(label), num_tokens=4)


def keys_of(batch: EventBatch) -> list[bytes]:
    return [event.prefix_key for event in batch.events]


class Wakes:
    """A watcher's wake callback that counts its calls."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def watch(journal: EventJournal, from_sequence: int = 0, log_name: str | None = None, wake=None):
    return journal.subscribe(log_name, journal.incarnation, from_sequence, wake or Wakes())


def test_sequences_start_at_0_and_follow_each_other_in_batches_of_at_most_limit() -> None:
    journal = EventJournal(history=16)
    watcher = watch(journal)
    assert journal.take(watcher, 10) == EventBatch(journal.incarnation, 0, [])
    journal.publish([stored(0), stored(1), stored(2)])
    journal.publish([stored(3)])
    first = journal.take(watcher, 3)
    assert (first.first_sequence, keys_of(first)) == (0, [digest(0), digest(1), digest(2)])
    second = journal.take(watcher, 3)
    assert (second.first_sequence, keys_of(second)) == (3, [digest(3)])
    assert journal.take(watcher, 3).events == []
    assert journal.stats().next_sequence == 4


def test_the_history_wraps_around_keeping_the_last_events() -> None:
    journal = EventJournal(history=4)
    journal.publish([stored(index) for index in range(10)])  # events 6..9 are held
    assert journal.stats().num_held == 4
    resumed = journal.take(watch(journal, from_sequence=6), 10)
    assert (resumed.first_sequence, keys_of(resumed)) == (6, [digest(index) for index in range(6, 10)])
    assert journal.take(watch(journal, from_sequence=10), 10).events == []  # at the head: live events only


@pytest.mark.parametrize("incarnation_of, from_sequence, reason", [
    (lambda journal: journal.incarnation, 5, BEHIND_HISTORY),  # event 5 was overwritten
    (lambda journal: journal.incarnation, 11, AHEAD_OF_HISTORY),  # no event 11 was ever published
    (lambda journal: "an earlier daemon's", 8, NEW_INCARNATION),
    (lambda journal: "", 0, NEW_INCARNATION),  # a first connect
])
def test_a_cursor_that_cannot_follow_on_is_answered_lost_then_resumes_at_the_head(incarnation_of, from_sequence,
                                                                                   reason) -> None:
    journal = EventJournal(history=4)
    journal.publish([stored(index) for index in range(10)])
    watcher = journal.subscribe(None, incarnation_of(journal), from_sequence, Wakes())
    assert journal.take(watcher, 10) == Lost(reason, journal.incarnation, resume_sequence=10)
    journal.publish([stored(10)])
    after = journal.take(watcher, 10)
    assert (after.first_sequence, keys_of(after)) == (10, [digest(10)])
    assert journal.stats().lost[reason] == 1


def test_a_watcher_more_than_history_behind_is_marked_too_slow_and_told_at_its_next_take() -> None:
    journal = EventJournal(history=4)
    slow, keeping_up = watch(journal), watch(journal)
    journal.publish([stored(index) for index in range(4)])
    assert keys_of(journal.take(keeping_up, 10)) == [digest(index) for index in range(4)]
    # slow has 4 unsent events: its whole window, nothing lost yet.
    journal.publish([stored(4)])  # a fifth overwrites event 0, which slow never got
    journal.publish([stored(5), stored(6)])
    assert journal.take(slow, 10) == Lost(TOO_SLOW, journal.incarnation, resume_sequence=7)
    assert journal.take(keeping_up, 10).first_sequence == 4, "a watcher that keeps up never loses events"
    journal.publish([stored(7)])
    assert keys_of(journal.take(slow, 10)) == [digest(7)]
    assert journal.stats().num_dropped == 7  # events 0..6 reached slow only through its resync


def test_publishing_never_waits_for_a_watcher_that_never_takes() -> None:
    journal = EventJournal(history=100)
    wakes = Wakes()
    watch(journal, wake=wakes)
    for index in range(20_000):
        journal.publish([stored(index)])
    stats = journal.stats()
    assert (stats.next_sequence, stats.num_held) == (20_000, 100), "the history stays bounded"
    assert wakes.count == 1, "one wake until the watcher takes: a stalled loop is not flooded with callbacks"


def test_a_wake_that_fails_never_reaches_the_publisher() -> None:
    def broken_wake() -> None:
        raise RuntimeError("event loop is closed")

    journal = EventJournal(history=8)
    watcher = watch(journal, wake=broken_wake)
    journal.publish([stored(0)])
    assert keys_of(journal.take(watcher, 10)) == [digest(0)]


def test_a_failure_inside_publish_resets_the_history_and_every_watcher_resyncs() -> None:
    journal = EventJournal(history=8)
    watcher = watch(journal)
    journal.publish([stored(0)])
    before = journal.incarnation

    def broken_owner_lookup(namespace: bytes) -> str | None:
        raise KeyError(namespace)

    journal.set_owner_lookup(broken_owner_lookup)
    journal.publish([stored(1)])  # does not raise into the writer
    assert journal.incarnation != before
    assert journal.take(watcher, 10) == Lost(NEW_INCARNATION, journal.incarnation, resume_sequence=0)


def test_each_tenant_has_a_log_of_its_own_numbered_without_gaps() -> None:
    journal = EventJournal(history=8)
    journal.set_owner_lookup({ALICE_NAMESPACE: "alice", BOB_NAMESPACE: "bob"}.get)
    everything, alice = watch(journal), watch(journal, log_name="alice")
    journal.publish([stored("a0", ALICE_NAMESPACE), stored("b0", BOB_NAMESPACE), stored("raw")])
    journal.publish([stored("a1", ALICE_NAMESPACE)])
    mine = journal.take(alice, 10)
    assert (mine.first_sequence, keys_of(mine)) == (0, [digest("a0"), digest("a1")])
    assert keys_of(journal.take(everything, 10)) == [digest("a0"), digest("b0"), digest("raw"), digest("a1")]
    # A tenant's cursor counts in its own log: alice resumes at 2, not at the daemon-wide 4.
    assert journal.take(watch(journal, from_sequence=2, log_name="alice"), 10).events == []
    assert journal.take(watch(journal, from_sequence=3, log_name="alice"), 10).reason == AHEAD_OF_HISTORY


def test_close_ends_every_watch_and_wakes_it() -> None:
    journal = EventJournal(history=8)
    wakes = Wakes()
    watcher = watch(journal, wake=wakes)
    journal.close()
    assert wakes.count == 1 and journal.take(watcher, 10) is None


def test_unsubscribed_watchers_are_no_longer_counted_or_woken() -> None:
    journal = EventJournal(history=8)
    wakes = Wakes()
    watcher = watch(journal, wake=wakes)
    assert journal.stats().num_watchers == 1
    journal.unsubscribe(watcher)
    journal.publish([stored(0)])
    assert (journal.stats().num_watchers, wakes.count) == (0, 0)


def test_publishers_on_many_threads_get_one_gapless_sequence() -> None:
    journal = EventJournal(history=4000)
    watcher = watch(journal)

    def publish_many(thread: int) -> None:
        for index in range(500):
            journal.publish([stored(f"{thread}.{index}")])

    threads = [threading.Thread(target=publish_many, args=(thread,)) for thread in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    batch = journal.take(watcher, 5000)
    assert batch.first_sequence == 0 and len(set(keys_of(batch))) == 2000
    assert journal.stats().published[EventKind.STORED] == 2000
