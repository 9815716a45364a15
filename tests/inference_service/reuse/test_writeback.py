"""Write-back picks the quantization group by bits when none is configured."""
from __future__ import annotations

import threading

import torch

from kvboost_keys.chunking import Chunk
from inference_service.kv.codec import read_header
import pytest

from inference_service.reuse.writeback import PendingChunks, WriteBack, bounded_batches, encode_pending
from inference_service.store.protocol import StoreItem, StoreUnavailable
from inference_service.kv.blobs import group_size_for
from tests.conftest import wait_for


def test_group_size_defaults_by_bits_and_an_explicit_one_wins():
    assert (group_size_for(8, 0), group_size_for(4, 0)) == (64, 128)
    assert (group_size_for(8, 32), group_size_for(4, 32)) == (32, 32)


def pending(num_tokens: int = 130) -> PendingChunks:
    generator = torch.Generator().manual_seed(0)
    new_kv = [(torch.randn(1, 2, num_tokens, 8, generator=generator), torch.randn(1, 2, num_tokens, 8, generator=generator))
              for _ in range(2)]
    chunks = (Chunk(tuple(range(128)), 0, 0), Chunk((1, 2), 128, 0))
    return PendingChunks(b"ns", chunks, (b"k0", b"k1"), (None, None), new_kv, kv_start=0)


def test_encode_pending_stores_the_default_group_and_the_sink_token_in_the_first_chunk():
    for bits, group in ((8, 64), (4, 128)):
        first, second = (read_header(item.blob) for item in encode_pending(pending(), bits))
        assert (first.group_size, second.group_size) == (group, group)
        assert (first.sink_tokens, second.sink_tokens) == (1, 0)
    assert read_header(encode_pending(pending(), 8, group_size=16)[0].blob).group_size == 16
    assert read_header(encode_pending(pending(), 16)[0].blob).sink_tokens == 0


class RecordingStore:
    """Records the blob sizes of each store call; fails the call numbered `fail_at` (0-based) when set."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[list[int]] = []
        self.fail_at = fail_at

    def store(self, items) -> int:
        if len(self.calls) == self.fail_at:
            self.calls.append([])
            raise StoreUnavailable("Store: DEADLINE_EXCEEDED")
        self.calls.append([len(item.blob) for item in items])
        return len(items)


def many_chunks(num_chunks: int, chunk_tokens: int = 16) -> PendingChunks:
    num_tokens = num_chunks * chunk_tokens
    generator = torch.Generator().manual_seed(1)
    new_kv = [(torch.randn(1, 2, num_tokens, 8, generator=generator), torch.randn(1, 2, num_tokens, 8, generator=generator))
              for _ in range(2)]
    chunks = tuple(Chunk(tuple(range(chunk_tokens)), i * chunk_tokens, 0) for i in range(num_chunks))
    keys = tuple(bytes([i]) * 32 for i in range(num_chunks))
    return PendingChunks(b"ns", chunks, keys, (None,) * num_chunks, new_kv, kv_start=0)


def test_a_large_write_back_goes_out_as_bounded_store_calls_in_order():
    blob_bytes = len(encode_pending(many_chunks(1), 16)[0].blob)
    store, counted = RecordingStore(), []
    writeback = WriteBack(store, 16, lambda chunks, num_bytes: counted.append((chunks, num_bytes)),
                          max_stream_bytes=3 * blob_bytes)
    try:
        assert writeback.store_now(many_chunks(8)) == 8
    finally:
        writeback.close()
    assert [len(call) for call in store.calls] == [3, 3, 2]
    assert all(sum(call) <= 3 * blob_bytes for call in store.calls)
    assert counted == [(3, 3 * blob_bytes), (3, 3 * blob_bytes), (2, 2 * blob_bytes)]


def test_a_failed_store_call_keeps_what_the_calls_before_it_stored():
    blob_bytes = len(encode_pending(many_chunks(1), 16)[0].blob)
    store, counted = RecordingStore(fail_at=1), []
    writeback = WriteBack(store, 16, lambda chunks, num_bytes: counted.append(chunks), max_stream_bytes=2 * blob_bytes)
    try:
        with pytest.raises(StoreUnavailable):
            writeback.store_now(many_chunks(6))
    finally:
        writeback.close()
    assert counted == [2]  # the first call's chunks are stored and counted; the rest were never sent
    assert len(store.calls) == 2


def test_bounded_batches_send_an_oversized_item_alone():
    sizes = [5, 1, 9, 2, 2, 2]
    items = [StoreItem(bytes([i]) * 32, b"ns", None, 1, b"x" * size) for i, size in enumerate(sizes)]
    assert [[len(item.blob) for item in batch] for batch in bounded_batches(items, 6)] == [[5, 1], [9], [2, 2, 2]]


def test_write_backs_in_flight_count_queued_and_running_ones_until_each_ends():
    release = threading.Event()

    class HeldStore(RecordingStore):
        def store(self, items) -> int:
            release.wait(timeout=30)
            return super().store(items)

    writeback = WriteBack(HeldStore(), 16, lambda chunks, num_bytes: None)
    ended = threading.Semaphore(0)
    try:
        assert writeback.num_in_flight == 0
        for _ in range(2):  # one running (held in its store call), one queued behind it
            writeback.submit(many_chunks(1), lambda stored, error: ended.release())
        assert writeback.num_in_flight == 2
        release.set()
        for _ in range(2):
            assert ended.acquire(timeout=30)
        wait_for(lambda: writeback.num_in_flight == 0, "both write-backs to leave the count", timeout_s=30)
    finally:
        release.set()
        writeback.close()
