"""Assembler helpers: the prefetching iterator that overlaps receiving blobs with decoding them."""
from __future__ import annotations

import threading

import pytest

from inference_service.reuse.assembler import prefetched
from inference_service.store.protocol import StoreUnavailable


def test_prefetched_keeps_the_order():
    assert list(prefetched(iter(range(100)))) == list(range(100))


def test_prefetched_raises_the_sources_error_in_order():
    def source():
        yield 1
        yield 2
        raise StoreUnavailable("stream broke")

    received = []
    with pytest.raises(StoreUnavailable, match="stream broke"):
        for item in prefetched(source()):
            received.append(item)
    assert received == [1, 2]


def test_stopping_early_closes_the_source_on_the_helper_thread():
    closed = threading.Event()
    release = threading.Event()

    def source():
        try:
            yield "first"
            release.wait(timeout=5)  # a stream still receiving when the consumer gives up
            yield "second"
            yield "never read"
        finally:
            closed.set()

    items = prefetched(source())
    assert next(items) == "first"
    items.close()
    release.set()
    assert closed.wait(timeout=5), "the source was not closed after the consumer stopped"
