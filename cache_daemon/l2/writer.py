"""Write-behind to L2: a bounded queue drained by one thread; a full queue drops writes, never blocks."""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Sequence

from cache_daemon.entry import IncomingChunk

logger = logging.getLogger(__name__)

MAX_BATCH_CHUNKS = 32


class WriteBehindQueue:
    """`submit` returns at once; chunks beyond `max_bytes` queued (or failing to write) are counted
    in `num_dropped`, not retried: L2 is a cache, and LMDB already holds them."""

    def __init__(self, write: Callable[[Sequence[IncomingChunk]], None], max_bytes: int) -> None:
        assert max_bytes > 0, f"the write-behind queue needs a positive byte bound, got {max_bytes}"
        self._write = write
        self.max_bytes = max_bytes
        self._condition = threading.Condition()
        self._queue: deque[IncomingChunk] = deque()
        self._queued_bytes = 0
        self._closed = False
        self._busy = False
        self._num_in_flight = 0
        self.num_written = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="l2-writer", daemon=True)
        self._thread.start()

    def submit(self, chunks: Sequence[IncomingChunk]) -> int:
        """Queues what fits; returns how many chunks were dropped."""
        dropped = 0
        with self._condition:
            for chunk in chunks:
                if self._closed or self._queued_bytes + len(chunk.blob) > self.max_bytes:
                    dropped += 1
                    continue
                self._queue.append(chunk)
                self._queued_bytes += len(chunk.blob)
            self.num_dropped += dropped
            self._condition.notify()
        if dropped:
            logger.debug("L2 write-behind queue full (%d bytes): dropped %d chunks", self.max_bytes, dropped)
        return dropped

    @property
    def num_queued(self) -> int:
        """Chunks submitted and not yet written or dropped (the batch being written included)."""
        with self._condition:
            return len(self._queue) + self._num_in_flight

    def drain(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued chunk was written or dropped; False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        self.drain(timeout_s)
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._queue or self._closed)
                if self._closed and not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(MAX_BATCH_CHUNKS, len(self._queue)))]
                self._queued_bytes -= sum(len(chunk.blob) for chunk in batch)
                self._busy = True
                self._num_in_flight = len(batch)
            try:
                self._write(batch)
                written, dropped = len(batch), 0
            except Exception as error:  # L2Unavailable, logged once per outage by the tier
                logger.debug("L2 write-behind of %d chunks failed: %s", len(batch), error)
                written, dropped = 0, len(batch)
            with self._condition:
                self.num_written += written
                self.num_dropped += dropped
                self._busy = False
                self._num_in_flight = 0
                self._condition.notify_all()
