"""One daemon's WatchEvents replies turned into its holdings, with the cursor to resume from (pure, no I/O).

The contract (cache.proto, WatchEvents): events come in consecutive sequences within one incarnation; a consumer
the daemon cannot resume is answered `lost`, then snapshot pages of every key held, the last one marked, then
events from `resume_sequence`. The snapshot replaces what was known; until its last page the old holdings keep
answering lookups, so a resync never leaves a replica looking empty.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvboost.v1 import cache_pb2
from router.index import DaemonHoldings


class EventGap(RuntimeError):
    """The stream skipped a sequence or changed incarnation without saying `lost`: reconnect from the cursor."""


@dataclass(slots=True, frozen=True)
class Cursor:
    incarnation: str  # empty: nothing known, the daemon answers `lost` and a snapshot
    next_sequence: int


NO_CURSOR = Cursor("", 0)


class EventFeed:
    """Applies replies in order; `cursor` is where a new stream resumes without losing or repeating anything."""

    def __init__(self, holdings: DaemonHoldings | None = None) -> None:
        self.holdings = holdings or DaemonHoldings()
        self._incarnation = ""
        self._next_sequence = 0
        self._snapshot: DaemonHoldings | None = None  # being filled between `lost` and the last page
        self.num_events = 0
        self.num_resyncs = 0

    @property
    def live(self) -> bool:
        """True once a snapshot completed (or a stream resumed): holdings follow the daemon event by event."""
        return bool(self._incarnation) and self._snapshot is None

    @property
    def cursor(self) -> Cursor:
        """Where to resume. Mid-snapshot there is nothing to resume: the next stream must send a whole one."""
        return Cursor(self._incarnation, self._next_sequence) if self.live else NO_CURSOR

    def interrupted(self) -> None:
        """The stream broke: a half-received snapshot is dropped (the next stream sends a whole one)."""
        if self._snapshot is not None:
            self._snapshot = None
            self._incarnation = ""

    def receive(self, reply: cache_pb2.WatchEventsReply) -> None:
        """Raises EventGap when the reply does not follow what came before."""
        body = reply.WhichOneof("body")
        if body == "lost":
            self._begin_snapshot(reply.lost)
        elif body == "snapshot":
            self._receive_page(reply.snapshot)
        elif body == "events":
            self._receive_events(reply.incarnation, reply.events.events)

    def _begin_snapshot(self, lost: cache_pb2.KvEventsLost) -> None:
        self._incarnation = lost.incarnation
        self._next_sequence = lost.resume_sequence
        self._snapshot = DaemonHoldings()
        self.num_resyncs += 1

    def _receive_page(self, page: cache_pb2.KvSnapshotPage) -> None:
        if self._snapshot is None:
            raise EventGap("a snapshot page came without `lost` before it")
        self._snapshot.add_snapshot(page.entries)
        if page.last:
            self.holdings.replace_with(self._snapshot)
            self._snapshot = None

    def _receive_events(self, incarnation: str, events) -> None:
        if not self.live:
            raise EventGap("events came before the snapshot was complete")
        if incarnation != self._incarnation:
            raise EventGap(f"incarnation changed from {self._incarnation} to {incarnation} without `lost`")
        for event in events:
            if event.sequence < self._next_sequence:
                continue  # already applied (a resumed stream may repeat its first events)
            if event.sequence > self._next_sequence:
                raise EventGap(f"expected event {self._next_sequence}, got {event.sequence}")
            self.holdings.apply(event)
            self._next_sequence = event.sequence + 1
            self.num_events += 1
