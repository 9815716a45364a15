"""KV events: a bounded, sequenced journal of what entered and left LMDB, and the cursors of its watchers."""
from __future__ import annotations

import enum
import logging
import secrets
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

DEFAULT_HISTORY = 65536

NEW_INCARNATION = "new incarnation"
BEHIND_HISTORY = "cursor behind history"
AHEAD_OF_HISTORY = "cursor ahead of history"
TOO_SLOW = "consumer too slow"
LOST_REASONS = (NEW_INCARNATION, BEHIND_HISTORY, AHEAD_OF_HISTORY, TOO_SLOW)


class EventKind(enum.Enum):
    STORED = "stored"  # written into LMDB by Store
    PROMOTED = "promoted"  # copied from L2 into LMDB by a Lookup
    EVICTED = "evicted"  # removed to keep the byte budget
    DELETED = "deleted"  # removed by Delete, or found corrupted
    CLEARED = "cleared"  # every chunk of a namespace removed (Delete by namespace)


@dataclass(slots=True, frozen=True)
class ChunkEvent:
    """One change of this daemon's LMDB, keys as stored (a tenant's still under its key permutation).
    CLEARED names only the namespace; only STORED and PROMOTED know the parent key."""

    kind: EventKind
    namespace: bytes
    prefix_key: bytes = b""
    content_key: bytes = b""
    num_tokens: int = 0
    parent_key: bytes = b""
    unix_time: float = 0.0


@dataclass(slots=True, frozen=True)
class Lost:
    """A watcher missed events: what it holds is to be replaced by a snapshot taken now, and events
    follow from resume_sequence."""

    reason: str
    incarnation: str
    resume_sequence: int


@dataclass(slots=True, frozen=True)
class EventBatch:
    incarnation: str
    first_sequence: int
    events: list[ChunkEvent]


@dataclass(slots=True, frozen=True)
class JournalStats:
    incarnation: str
    num_held: int  # events in the daemon-wide history
    next_sequence: int
    num_watchers: int
    published: dict[EventKind, int]
    lost: dict[str, int]  # watchers answered lost, by reason
    num_dropped: int  # events watchers did not get one by one (too slow or behind history): resynced instead


class _Log:
    """One sequence of events (the daemon-wide one, or one tenant's), the last `capacity` kept in a ring."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.next_sequence = 0
        self.watchers: set[Watcher] = set()
        self._ring: list[ChunkEvent] = []  # event s at s % capacity; grows to capacity, then wraps

    @property
    def first_sequence(self) -> int:
        return self.next_sequence - len(self._ring)

    def append(self, event: ChunkEvent) -> None:
        if len(self._ring) < self.capacity:
            self._ring.append(event)
        else:
            self._ring[self.next_sequence % self.capacity] = event
        self.next_sequence += 1

    def read(self, start: int, limit: int) -> list[ChunkEvent]:
        assert start >= self.first_sequence, f"event {start} left the history (first held: {self.first_sequence})"
        return [self._ring[sequence % self.capacity]
                for sequence in range(start, min(self.next_sequence, start + limit))]


@dataclass(eq=False)
class Watcher:
    """One stream's place in a log. `wake` is called (from any thread, never under the journal's lock)
    when there is something new to take; it must not block."""

    log: _Log
    wake: Callable[[], None]
    cursor: int = 0
    lost_reason: str | None = None
    wake_pending: bool = field(default=False, repr=False)


class EventJournal:
    """Thread-safe. Writers publish after their LMDB commit, under the cache's write lock, so the
    sequence order is the commit order. Every event goes into the daemon-wide log and, when its
    namespace has an owner (tenancy), into that tenant's log too: each log numbers its own events,
    so a tenant's stream has no gaps where other tenants' events were.

    Each watcher's queue is its window into its log: at most `history` events it has not taken yet.
    Publishing never waits for a watcher: one that falls further behind is marked lost and told so at
    its next take, then resyncs from a snapshot. The incarnation is new for every journal (each daemon
    start) and whenever the history is reset."""

    def __init__(self, history: int = DEFAULT_HISTORY) -> None:
        assert history >= 1, f"the event history must hold at least 1 event, got {history}"
        self.history = history
        self._lock = threading.Lock()
        self._owner_of: Callable[[bytes], str | None] = lambda namespace: None
        self._closed = False
        self._published: Counter[EventKind] = Counter()
        self._lost: Counter[str] = Counter()
        self._num_dropped = 0
        self._new_history()

    def _new_history(self) -> None:
        self.incarnation = secrets.token_hex(16)
        self._logs: dict[str | None, _Log] = {None: _Log(self.history)}  # None: the daemon-wide log

    def set_owner_lookup(self, owner_of: Callable[[bytes], str | None]) -> None:
        """Stored namespace -> owning tenant (None: no owner), for routing events into tenants' logs."""
        self._owner_of = owner_of

    def publish(self, events: Sequence[ChunkEvent]) -> None:
        """Appends committed changes. Never blocks on a watcher and never raises: a failure here resets
        the history (new incarnation, every watcher resyncs) rather than fail the write it reports."""
        if not events:
            return
        try:
            with self._lock:
                touched = {self._logs[None]}
                for event in events:
                    self._logs[None].append(event)
                    owner = self._owner_of(event.namespace)
                    if owner is not None:
                        log = self._log(owner)
                        log.append(event)
                        touched.add(log)
                    self._published[event.kind] += 1
                to_wake = [watcher for log in touched for watcher in self._watchers_to_wake(log)]
        except Exception:
            logger.exception("publishing %d KV events failed: the event history is reset", len(events))
            self.reset()
            return
        _wake_all(to_wake)

    def _watchers_to_wake(self, log: _Log) -> list[Watcher]:
        """Marks the watchers that fell more than `history` events behind lost; returns those not yet woken."""
        woken = []
        for watcher in log.watchers:
            if watcher.lost_reason is None and log.next_sequence - watcher.cursor > log.capacity:
                watcher.lost_reason = TOO_SLOW
            if not watcher.wake_pending:
                watcher.wake_pending = True
                woken.append(watcher)
        return woken

    def _log(self, name: str | None) -> _Log:
        log = self._logs.get(name)
        if log is None:
            log = self._logs[name] = _Log(self.history)
        return log

    def subscribe(self, log_name: str | None, incarnation: str, from_sequence: int,
                  wake: Callable[[], None]) -> Watcher:
        """A watcher of the daemon-wide log (None) or of one tenant's, at from_sequence when that is still
        in this incarnation's history (or is the next sequence); else its first take answers Lost."""
        with self._lock:
            log = self._log(log_name)
            watcher = Watcher(log, wake, cursor=log.next_sequence)
            if incarnation != self.incarnation:
                watcher.lost_reason = NEW_INCARNATION
            elif from_sequence < log.first_sequence:
                watcher.lost_reason = BEHIND_HISTORY
                self._num_dropped += log.first_sequence - from_sequence
            elif from_sequence > log.next_sequence:
                watcher.lost_reason = AHEAD_OF_HISTORY
            else:
                watcher.cursor = from_sequence
            log.watchers.add(watcher)
            return watcher

    def take(self, watcher: Watcher, limit: int) -> EventBatch | Lost | None:
        """The watcher's next events (at most limit; none yet: an empty batch), or Lost (the watcher then
        resumes at the next sequence), or None once the journal is closed."""
        with self._lock:
            watcher.wake_pending = False
            if self._closed:
                return None
            log = watcher.log
            if watcher.lost_reason is not None:
                lost = Lost(watcher.lost_reason, self.incarnation, log.next_sequence)
                if watcher.lost_reason == TOO_SLOW:
                    self._num_dropped += log.next_sequence - watcher.cursor
                self._lost[watcher.lost_reason] += 1
                watcher.cursor, watcher.lost_reason = log.next_sequence, None
                return lost
            batch = EventBatch(self.incarnation, watcher.cursor, log.read(watcher.cursor, limit))
            watcher.cursor += len(batch.events)
            return batch

    def unsubscribe(self, watcher: Watcher) -> None:
        with self._lock:
            watcher.log.watchers.discard(watcher)

    def reset(self) -> None:
        """Forgets the history and starts a new incarnation; every watcher is told it lost events."""
        with self._lock:
            watchers = [(name, watcher) for name, log in self._logs.items() for watcher in log.watchers]
            self._new_history()
            for name, watcher in watchers:
                watcher.log = self._log(name)
                watcher.log.watchers.add(watcher)
                watcher.cursor, watcher.lost_reason, watcher.wake_pending = 0, NEW_INCARNATION, True
        _wake_all([watcher for _, watcher in watchers])

    def close(self) -> None:
        """Ends every watch: their next take answers None (the daemon is stopping)."""
        with self._lock:
            self._closed = True
            watchers = [watcher for log in self._logs.values() for watcher in log.watchers]
        _wake_all(watchers)

    def stats(self) -> JournalStats:
        with self._lock:
            log = self._logs[None]
            return JournalStats(incarnation=self.incarnation, num_held=log.next_sequence - log.first_sequence,
                                next_sequence=log.next_sequence,
                                num_watchers=sum(len(log.watchers) for log in self._logs.values()),
                                published={kind: self._published[kind] for kind in EventKind},
                                lost={reason: self._lost[reason] for reason in LOST_REASONS},
                                num_dropped=self._num_dropped)


def _wake_all(watchers: Sequence[Watcher]) -> None:
    for watcher in watchers:
        try:
            watcher.wake()
        except Exception:  # e.g. the watcher's event loop closed under it: it has nothing left to wake
            logger.debug("waking a KV events watcher failed", exc_info=True)
