"""L2 values on their way into LMDB after the Lookup that reported them: which keys are arriving, until when,
and how a reader waits for one (pure bookkeeping, no I/O)."""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

from cache_daemon.entry import ChunkKey

# A promotion of B bytes may take PROMOTE_FIXED_S + B / PROMOTE_FLOOR_BYTES_PER_S: the same floor as a Store
# stream's deadline in the service, so a busy machine slows a promotion down without turning it into misses.
PROMOTE_FIXED_S = 2.0
PROMOTE_FLOOR_BYTES_PER_S = 16e6
# At most this many record bytes held in memory at once while a promotion copies them into LMDB.
PROMOTE_BATCH_BYTES = 64 << 20


def promotion_deadline_s(num_bytes: int) -> float:
    return PROMOTE_FIXED_S + num_bytes / PROMOTE_FLOOR_BYTES_PER_S


def sized_batches(sized: Sequence[tuple[ChunkKey, int]], max_chunks: int,
                  max_bytes: int = PROMOTE_BATCH_BYTES) -> Iterator[list[ChunkKey]]:
    """The keys in order, cut into batches of at most max_chunks keys and max_bytes bytes (a lone larger
    record is a batch of its own)."""
    assert max_chunks >= 1, f"max_chunks must be >= 1, got {max_chunks}"
    batch: list[ChunkKey] = []
    batch_bytes = 0
    for key, size in sized:
        if batch and (len(batch) == max_chunks or batch_bytes + size > max_bytes):
            yield batch
            batch, batch_bytes = [], 0
        batch.append(key)
        batch_bytes += size
    if batch:
        yield batch


class ArrivingKeys:
    """Keys a Lookup answered from L2 and whose promotion into LMDB has not finished, each with the
    deadline of its promotion. Thread-safe. A reader that misses such a key in LMDB waits for it
    (`wait`) instead of answering a miss; the promotion releases every key it was given, stored or not."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._condition = threading.Condition()
        self._deadlines: dict[ChunkKey, float] = {}

    def claim(self, keys: Iterable[ChunkKey], deadline: float) -> list[ChunkKey]:
        """Marks the keys arriving until deadline; returns those not already arriving (this caller promotes them)."""
        with self._condition:
            claimed = [key for key in dict.fromkeys(keys) if key not in self._deadlines]
            for key in claimed:
                self._deadlines[key] = deadline
            return claimed

    def arriving(self, keys: Iterable[ChunkKey]) -> set[ChunkKey]:
        with self._condition:
            return {key for key in keys if key in self._deadlines}

    def release(self, keys: Iterable[ChunkKey]) -> None:
        with self._condition:
            for key in keys:
                self._deadlines.pop(key, None)
            self._condition.notify_all()

    def wait(self, key: ChunkKey) -> bool:
        """Waits until the key's promotion released it or its deadline passed; False when it was not arriving."""
        with self._condition:
            deadline = self._deadlines.get(key)
            if deadline is None:
                return False
            while key in self._deadlines:
                remaining = self._deadlines[key] - self._clock()
                if remaining <= 0:
                    return True
                self._condition.wait(remaining)
            return True

    def wait_all(self, timeout_s: float | None = None) -> bool:
        """Until no key is arriving (tests, shutdown); False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: not self._deadlines, timeout_s)

    def snapshot(self) -> set[ChunkKey]:
        with self._condition:
            return set(self._deadlines)

    def __len__(self) -> int:
        with self._condition:
            return len(self._deadlines)
