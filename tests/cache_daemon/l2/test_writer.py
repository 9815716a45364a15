"""The write-behind queue: bounded by bytes, drops (and counts) rather than blocking, drains in order."""
from __future__ import annotations

import threading

from cache_daemon.entry import ChunkKey, IncomingChunk
from cache_daemon.l2.writer import WriteBehindQueue
from tests.daemon_support import NAMESPACE, digest


def chunk(label: str, size_bytes: int) -> IncomingChunk:
    return IncomingChunk(key=ChunkKey(digest(label)), namespace=NAMESPACE, content_key=b"", num_tokens=4,
                         checksum=0, pinned=False, blob=bytes(size_bytes))


def test_a_full_queue_drops_and_counts_instead_of_blocking():
    release, writing = threading.Event(), threading.Event()
    written: list[str] = []

    def slow_write(chunks):
        writing.set()
        release.wait(10)
        written.extend(c.key.hex()[:4] for c in chunks)

    queue = WriteBehindQueue(slow_write, max_bytes=250)
    try:
        assert queue.submit([chunk("first", 100)]) == 0  # the writer takes it and blocks in slow_write
        assert writing.wait(10)
        assert queue.drain(0.05) is False
        # 100 + 100 fit beside nothing else queued; the third would pass 250 bytes: dropped at once.
        assert queue.submit([chunk("a", 100), chunk("b", 100), chunk("c", 100)]) == 1
        assert (queue.num_dropped, queue.num_queued) == (1, 3)  # two queued, one being written
        release.set()
        assert queue.drain(10)
        assert written == [digest(label).hex()[:4] for label in ("first", "a", "b")]
        assert (queue.num_written, queue.num_dropped, queue.num_queued) == (3, 1, 0)
    finally:
        release.set()
        queue.close()


def test_failed_writes_are_dropped_and_counted():
    def failing_write(chunks):
        raise ConnectionError("L2 down")

    queue = WriteBehindQueue(failing_write, max_bytes=1 << 20)
    try:
        queue.submit([chunk("x", 10), chunk("y", 10)])
        assert queue.drain(10)
        assert (queue.num_written, queue.num_dropped) == (0, 2)
    finally:
        queue.close()
