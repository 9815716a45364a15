"""Iterates a stream on a helper thread, ahead of its consumer (receiving the next blob overlaps placing this one)."""
from __future__ import annotations

import queue
import threading
from typing import Iterator, TypeVar

_DONE = object()  # marks the end of a prefetched stream
T = TypeVar("T")


def prefetched(items: Iterator[T]) -> Iterator[T]:
    """Iterates `items` on a helper thread, ahead of the consumer.

    Receiving the next blob (network, parsing, checksum) then overlaps decoding and copying the current
    one; the queue holds at most the run's blobs, which the consumer copies out anyway. An exception
    raised by `items` reaches the consumer in order. When the consumer stops early, the helper stops
    after the item it is receiving and closes `items` (ending the stream) on its own thread.
    """
    ready: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def drain() -> None:
        try:
            for item in items:
                if stop.is_set():
                    break
                ready.put((item, None))
            ready.put((_DONE, None))
        except BaseException as error:  # handed to the consumer, never lost on this thread
            ready.put((_DONE, error))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    threading.Thread(target=drain, name="kvboost-fetch", daemon=True).start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
