"""Store stream assembly (every malformed stream named) and the wire encoding of Fetch frames."""
from __future__ import annotations

import zlib

import pytest
from kvboost.v1 import cache_pb2

from cache_daemon.errors import BudgetExceeded, InvalidCacheRequest
from cache_daemon.framing import MAX_FRAME_BYTES, StoreStreamAssembler, encode_data_frames, encode_header_frame
from tests.daemon_support import header_frame, make_chunk, store_frames


def assemble(frames, max_blob_bytes: int = 1 << 30):
    assembler = StoreStreamAssembler(max_blob_bytes)
    for frame in frames:
        assembler.feed(frame)
    return assembler.finish()


def test_chunks_are_reassembled_from_frames_of_any_size() -> None:
    chunks = [make_chunk("a", 2_500_000), make_chunk("b", 10), make_chunk("c", 0)]
    assembled = assemble(store_frames(chunks, frame_bytes=700_000))
    assert [(chunk.key, chunk.blob, chunk.checksum) for chunk in assembled] == \
        [(chunk.key, chunk.blob, chunk.checksum) for chunk in chunks]


@pytest.mark.parametrize("frames, message", [
    ([cache_pb2.ChunkFrame(data=b"x")], "data frame came before any header"),
    ([cache_pb2.ChunkFrame()], "must carry a header or data"),
    ([header_frame(make_chunk("a", 10)), cache_pb2.ChunkFrame(data=b"x" * 11)], "carry more than its size_bytes"),
    ([header_frame(make_chunk("a", 10)), cache_pb2.ChunkFrame(data=b"x" * 5)], "ended after 5 of its 10 bytes"),
    ([header_frame(make_chunk("a", 10)), header_frame(make_chunk("b", 10))], "ended after 0 of its 10 bytes"),
    ([header_frame(make_chunk("a", 10), checksum=7), cache_pb2.ChunkFrame(data=make_chunk("a", 10).blob)],
     "CRC-32 of the data is"),
    ([header_frame(make_chunk("a"), key=b"short")], "ChunkMeta.key must be 32 bytes, got 5"),
    ([header_frame(make_chunk("a"), key=b"")], "ChunkMeta.key must be 32 bytes, got 0"),
    ([header_frame(make_chunk("a"), namespace=b"")], "ChunkMeta.namespace must be 32 bytes"),
    ([header_frame(make_chunk("a"), content_key=b"x")], "ChunkMeta.content_key must be 32 bytes"),
])
def test_malformed_streams_are_invalid_requests(frames, message: str) -> None:
    with pytest.raises(InvalidCacheRequest, match=message):
        assemble(frames)


def test_a_data_frame_over_1_mib_is_refused() -> None:
    chunk = make_chunk("big", MAX_FRAME_BYTES + 1)
    with pytest.raises(InvalidCacheRequest, match="more than 1048576"):
        assemble(store_frames([chunk], frame_bytes=MAX_FRAME_BYTES + 1))


def test_a_blob_over_the_budget_is_refused_at_its_header() -> None:
    with pytest.raises(BudgetExceeded):
        assemble([header_frame(make_chunk("a", 101))], max_blob_bytes=100)


def test_encoded_frames_are_chunk_frames_of_at_most_1_mib() -> None:
    blob = make_chunk("x", 2 * MAX_FRAME_BYTES + 300).blob
    frames = [cache_pb2.ChunkFrame.FromString(frame) for frame in encode_data_frames(memoryview(blob))]
    assert [len(frame.data) for frame in frames] == [MAX_FRAME_BYTES, MAX_FRAME_BYTES, 300]
    assert b"".join(frame.data for frame in frames) == blob
    # Short frames use a one-byte length.
    assert cache_pb2.ChunkFrame.FromString(encode_data_frames(memoryview(b"abc"))[0]).data == b"abc"
    assert encode_data_frames(memoryview(b"")) == []


def test_header_frames_round_trip() -> None:
    meta = cache_pb2.ChunkMeta(key=b"k" * 32, size_bytes=5, checksum=zlib.crc32(b"hello"), frequency=2.5)
    frame = cache_pb2.ChunkFrame.FromString(encode_header_frame(meta, found=True))
    assert frame.header.found and frame.header.meta == meta
