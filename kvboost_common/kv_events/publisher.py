"""The KV-event publisher: one thread that turns a tier's chunk changes into vLLM's KV events on a ZMQ PUB socket,
and answers replay requests on a ROUTER socket. It never blocks its callers (they only queue) and runs no torch op.

Imported only when --kv-events-endpoint is set: pyzmq and msgpack load here.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvboost_common.kv_events.block_grid import BlockGrid, ChunkTokens
from kvboost_common.kv_events.replay_ring import ReplayRing
from kvboost_common.kv_events.wire import (REPLAY_END_SEQUENCE, all_blocks_cleared, encode_batch, encode_sequence,
                                           message_frames)

logger = logging.getLogger(__name__)

_STOP = object()
# How long the thread waits for work before it looks at the replay socket again.
_REPLAY_POLL_S = 0.01


@dataclass(slots=True, frozen=True)
class KvEventsConfig:
    endpoint: str  # tcp://HOST:PORT (zmq_endpoint makes one of a flag's value)
    topic: str = ""
    replay_endpoint: str = ""  # empty: no replay
    block_size: int = 16
    medium: str = "GPU"
    replay_batches: int = 10_000  # batches the replay ring keeps
    high_water_mark: int = 10_000  # batches queued per subscriber before the PUB socket drops them (as the ring)
    publish_salted: bool = False  # announce chunks stored under a cache_salt or tenant scope too

    def __post_init__(self) -> None:
        assert self.endpoint, "a publisher needs an endpoint"
        assert self.block_size > 0, f"block_size must be positive, got {self.block_size}"
        assert self.replay_batches > 0 and self.high_water_mark > 0, "the ring and the high-water mark hold batches"


@dataclass(slots=True)
class PublisherStats:
    batches_sent: int = 0
    batches_dropped: int = 0  # the PUB socket was at its high-water mark (a replay still has them)
    events_sent: int = 0
    replays_served: int = 0
    busy_seconds: float = 0.0  # this thread's time turning chunk changes into sent batches


class KvEventPublisher:
    """Callers (the planning and tier threads) queue notes and chunk changes; the thread publishes them in order.

    Sequence numbers start at 0 in every process: a subscriber that sees a smaller one knows this replica restarted
    and forgets what it announced before.
    """

    def __init__(self, config: KvEventsConfig, seed: bytes, clock=time.time) -> None:
        self.config = config
        self.stats = PublisherStats()
        self._seed = seed
        self._clock = clock
        self._grid = BlockGrid(config.block_size, seed, config.medium)
        self._ring = ReplayRing(config.replay_batches)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._next_sequence = 0
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.high_water_mark)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kvboost-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing %s blocks of %d tokens on %s (topic %r)%s", config.medium,
                    config.block_size, config.endpoint, config.topic,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    # ---- what callers do: queue, never wait ----------------------------------------------------------

    def note_prompt(self, namespace: bytes, keys: Sequence[bytes], starts: Sequence[int],
                    token_ids: Sequence[Sequence[int]]) -> None:
        """A planned prompt's chunks, in order from position 0 (the first chains from the namespace). Chunks under
        another namespace than the seed's (a cache_salt's) are never announced unless publish_salted."""
        if namespace != self._seed and not self.config.publish_salted:
            return
        self._queue.put(("note", tuple(keys), tuple(starts), tuple(tuple(ids) for ids in token_ids)))

    def chunk_added(self, key: bytes, parent: bytes | None = None) -> None:
        self._queue.put(("add", key))

    def chunk_removed(self, key: bytes) -> None:
        self._queue.put(("remove", key))

    def clear(self) -> None:
        """The tier was emptied: AllBlocksCleared."""
        self._queue.put(("clear", None))

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until everything queued so far was published (tests, benchmarks); False on timeout."""
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout)

    def close(self) -> None:
        """Says AllBlocksCleared (a subscriber stops routing here at once, not at the restart), then stops."""
        self.clear()
        self._queue.put((_STOP, None))
        self._thread.join(timeout=5)
        self._pub.close(linger=500)  # ms for the last batch to leave
        if self._replay is not None:
            self._replay.close(0)

    # ---- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                items = [self._queue.get(timeout=_REPLAY_POLL_S if self._replay is not None else None)]
            except queue.Empty:
                items = []
            while True:  # everything queued now goes out as one batch
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if items:
                started = time.perf_counter()
                stop = self._publish(items)
                self.stats.busy_seconds += time.perf_counter() - started
                if stop:
                    return
            if self._replay is not None:
                self._maybe_serve_replays()

    def _publish(self, items: list) -> bool:
        events: list[dict] = []
        flushes, stop = [], False
        for kind, *rest in items:
            if kind == "note":
                self._note(*rest)
            elif kind == "add":
                events += self._grid.add(rest[0])
            elif kind == "remove":
                events += self._grid.remove(rest[0])
            elif kind == "clear":
                self._grid.clear()
                events.append(all_blocks_cleared())
            elif kind == "flush":
                flushes.append(rest[0])
            elif kind is _STOP:
                stop = True
        if events:
            self._send(events)
        for done in flushes:
            done.set()
        return stop

    def _note(self, keys: tuple[bytes, ...], starts: tuple[int, ...], token_ids: tuple[tuple[int, ...], ...]) -> None:
        parent = None
        for key, start, ids in zip(keys, starts, token_ids):
            self._grid.note(key, ChunkTokens(start, ids, parent))
            parent = key

    def _send(self, events: list[dict]) -> None:
        sequence, self._next_sequence = self._next_sequence, self._next_sequence + 1
        payload = encode_batch(self._clock(), events)
        self._ring.append(sequence, payload)
        try:
            self._pub.send_multipart(message_frames(self.config.topic, sequence, payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # a subscriber at the high-water mark: it catches up by replay, the loop never waits
            self.stats.batches_dropped += 1
            return
        self.stats.batches_sent += 1
        self.stats.events_sent += len(events)

    def _maybe_serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: a replay request of %d frames ignored (want identity, '', start)",
                               len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            topic = self.config.topic.encode()
            for sequence, payload in self._ring.since(max(0, start)):
                self._replay.send_multipart([identity, b"", topic, encode_sequence(sequence), payload])
            self._replay.send_multipart([identity, b"", topic, encode_sequence(REPLAY_END_SEQUENCE), b""])
            self.stats.replays_served += 1

