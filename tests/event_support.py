"""Test helpers for KV events: a WatchEvents stream read in a thread, and the consumer's view it builds."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
from kvboost.v1 import cache_pb2, cache_pb2_grpc

HeldKey = tuple[str, bytes, bytes]  # (tenant, namespace, prefix key)


@dataclass
class KeyView:
    """What a router would hold after applying a watch stream: lost replaces the held keys by the
    snapshot that follows, events apply in order. Asserts the contract as it goes: every event's
    sequence is the next one (no gap, no duplicate), incarnation included. skip_snapshot: the stream
    was asked for none, so a lost leaves nothing known."""

    skip_snapshot: bool = False
    held: set[HeldKey] = field(default_factory=set)
    incarnation: str = ""
    next_sequence: int = 0
    lost_reasons: list[str] = field(default_factory=list)
    events: list[cache_pb2.KvEvent] = field(default_factory=list)
    num_snapshot_entries: int = 0
    _snapshot: set[HeldKey] | None = None

    def apply(self, reply: cache_pb2.WatchEventsReply) -> None:
        body = reply.WhichOneof("body")
        if body == "lost":
            self.incarnation, self.next_sequence = reply.lost.incarnation, reply.lost.resume_sequence
            self.lost_reasons.append(reply.lost.reason)
            if self.skip_snapshot:
                self.held = set()
            else:
                self._snapshot = set()
        elif body == "snapshot":
            assert self._snapshot is not None, "a snapshot page without a lost before it"
            assert reply.incarnation == self.incarnation
            self._snapshot.update((entry.tenant, entry.namespace, entry.prefix_key) for entry in reply.snapshot.entries)
            self.num_snapshot_entries += len(reply.snapshot.entries)
            if reply.snapshot.last:
                self.held, self._snapshot = self._snapshot, None
        else:
            assert self._snapshot is None, "events before the snapshot's last page"
            assert reply.incarnation == self.incarnation, "events of another incarnation without a lost"
            for event in reply.events.events:
                assert event.sequence == self.next_sequence, f"event {event.sequence}, expected {self.next_sequence}"
                self.next_sequence += 1
                self._apply_event(event)
                self.events.append(event)

    def _apply_event(self, event: cache_pb2.KvEvent) -> None:
        held_key = (event.tenant, event.namespace, event.prefix_key)
        if event.kind in (cache_pb2.KV_EVENT_STORED, cache_pb2.KV_EVENT_PROMOTED):
            self.held.add(held_key)
        elif event.kind in (cache_pb2.KV_EVENT_EVICTED, cache_pb2.KV_EVENT_DELETED):
            self.held.discard(held_key)
        else:
            assert event.kind == cache_pb2.KV_EVENT_CLEARED and not event.prefix_key
            self.held = {key for key in self.held if key[:2] != (event.tenant, event.namespace)}

    @property
    def in_sync(self) -> bool:
        """Not in the middle of a snapshot."""
        return self._snapshot is None and bool(self.incarnation)


class EventStream:
    """One WatchEvents call whose replies a thread reads into a queue (reading starts with `start_reading`,
    so a test can leave a stream unread); `view` applies what the test took."""

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, request: cache_pb2.WatchEventsRequest,
                 metadata=None, view: KeyView | None = None) -> None:
        """view: what the consumer holds from an earlier stream (resuming at request.from_sequence)."""
        self.call = stub.WatchEvents(request, metadata=metadata)
        self.view = view or KeyView(skip_snapshot=request.skip_snapshot)
        self.ended = threading.Event()
        self.error: grpc.RpcError | None = None
        self._replies: queue.Queue[cache_pb2.WatchEventsReply] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start_reading(self) -> EventStream:
        self._reader.start()
        return self

    def _read(self) -> None:
        try:
            for reply in self.call:
                self._replies.put(reply)
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.ended.set()

    def next_reply(self, timeout_s: float = 10.0) -> cache_pb2.WatchEventsReply:
        reply = self._replies.get(timeout=timeout_s)
        self.view.apply(reply)
        return reply

    def until(self, condition: Callable[[KeyView], bool], timeout_s: float = 20.0) -> KeyView:
        """Applies replies until condition(view) holds."""
        deadline = time.monotonic() + timeout_s
        while not condition(self.view):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"the watch did not get there in {timeout_s} s: {self.view}"
            try:
                self.next_reply(remaining)
            except queue.Empty:
                continue
        return self.view

    def synced(self, timeout_s: float = 20.0) -> KeyView:
        """Through the opening lost and snapshot."""
        return self.until(lambda view: view.in_sync, timeout_s)

    def drain(self, quiet_s: float = 0.3) -> int:
        """Applies replies until none comes for quiet_s; returns how many came."""
        count = 0
        while True:
            try:
                self.next_reply(quiet_s)
            except queue.Empty:
                return count
            count += 1

    def close(self) -> None:
        self.call.cancel()
        if self._reader.is_alive():
            self._reader.join(timeout=10)
