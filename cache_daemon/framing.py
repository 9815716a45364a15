"""ChunkFrame streams: assembling Store uploads and wire-encoding Fetch replies."""
from __future__ import annotations

import hashlib
from typing import Sequence

from kvboost.v1 import cache_pb2

from kvboost_common.checksum import crc32
from kvboost_common.frames import MAX_FRAME_BYTES
from cache_daemon.deletes import WriterEpoch
from cache_daemon.entry import DIGEST_SIZE, ChunkKey, Entry, IncomingChunk
from cache_daemon.errors import InvalidCacheRequest, StoreStreamOverLimit, check_blob_fits

# ChunkFrame.data is field 2, length-delimited: tag = (2 << 3) | 2.
_DATA_FIELD_TAG = b"\x12"


def check_digest(value: bytes, what: str) -> None:
    if len(value) != DIGEST_SIZE:
        raise InvalidCacheRequest(f"{what} must be {DIGEST_SIZE} bytes, got {len(value)}")


MAX_CONTINUATION_TOKENS = 4096  # token ids a continuation carries (chunks are at most this long)


def check_continuation(parent_key: bytes, token_ids: bytes, what: str) -> None:
    """A continuation's parent key and packed token ids: both or neither, well formed."""
    if not parent_key and not token_ids:
        return
    if not parent_key or not token_ids:
        raise InvalidCacheRequest(f"{what}: give both the parent key and the token ids of a continuation, or neither")
    check_digest(parent_key, f"{what} parent key")
    if len(token_ids) % 4 or len(token_ids) > 4 * MAX_CONTINUATION_TOKENS:
        raise InvalidCacheRequest(f"{what} token ids must be little-endian uint32 values (a multiple of 4 bytes), "
                                  f"at most {MAX_CONTINUATION_TOKENS} of them; got {len(token_ids)} bytes")


def check_continue_after_run(pieces: Sequence[bytes], num_prefix_keys: int, with_continue_parent: bool) -> None:
    """LookupRequest.continue_after_run: at most one entry per run length (0..num_prefix_keys), each packed token ids
    of at most MAX_CONTINUATION_TOKENS, and not beside continue_parent (both would answer the continuation)."""
    if not pieces:
        return
    if with_continue_parent:
        raise InvalidCacheRequest("LookupRequest: give continue_after_run or continue_parent, not both")
    if len(pieces) > num_prefix_keys + 1:
        raise InvalidCacheRequest(f"LookupRequest.continue_after_run has {len(pieces)} entries; at most one per "
                                  f"run length 0..{num_prefix_keys} ({num_prefix_keys + 1})")
    for index, token_ids in enumerate(pieces):
        if len(token_ids) % 4 or len(token_ids) > 4 * MAX_CONTINUATION_TOKENS:
            raise InvalidCacheRequest(f"LookupRequest.continue_after_run[{index}] must be little-endian uint32 token "
                                      f"ids (a multiple of 4 bytes), at most {MAX_CONTINUATION_TOKENS} of them; got "
                                      f"{len(token_ids)} bytes")


def partial_chunk_keys(parent: bytes, token_ids: bytes) -> list[bytes]:
    """SHA-256(parent || token_ids[:4n]) for n = len down to 1: the keys of the partial chunks after `parent` that
    hold the first n of these packed token ids (the inference service's prefix chain), longest first."""
    running = hashlib.sha256(parent)
    keys = []
    for start in range(0, len(token_ids), 4):
        running.update(token_ids[start : start + 4])
        keys.append(running.copy().digest())
    keys.reverse()
    return keys


def chunk_meta(key: ChunkKey, entry: Entry) -> cache_pb2.ChunkMeta:
    return cache_pb2.ChunkMeta(
        key=key, namespace=entry.namespace, content_key=entry.content_key, num_tokens=entry.num_tokens,
        size_bytes=entry.size_bytes, checksum=entry.checksum, frequency=entry.frequency,
        last_access_unix=entry.last_access, pinned=entry.pinned,
    )


def encode_header_frame(meta: cache_pb2.ChunkMeta, found: bool) -> bytes:
    return cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=meta, found=found)).SerializeToString()


def encode_data_frames(blob: memoryview) -> list[bytes]:
    """The blob as wire-encoded ChunkFrame{data} messages of at most 1 MiB of data each.

    Fetch streams these bytes as they are: building ChunkFrame objects and serializing
    them would copy every blob twice more on the hottest path of the daemon.
    """
    return [
        b"".join((_DATA_FIELD_TAG, _varint(len(piece)), piece))
        for piece in (blob[start:start + MAX_FRAME_BYTES] for start in range(0, len(blob), MAX_FRAME_BYTES))
    ]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class StoreStreamAssembler:
    """Turns a Store stream (header, data..., header, data...) into checked IncomingChunks.

    Every chunk stays in memory until the stream ends (one LMDB transaction for all), so a stream is
    bounded: at most max_chunks chunks and max_stream_bytes blob bytes, refused at the header that would
    pass either bound, before its data arrives."""

    def __init__(self, max_blob_bytes: int, max_chunks: int | None = None, max_stream_bytes: int | None = None) -> None:
        self.max_blob_bytes = max_blob_bytes
        self.max_chunks = max_chunks
        self.max_stream_bytes = max_stream_bytes
        self._num_declared_bytes = 0
        self.chunks: list[IncomingChunk] = []
        self._meta: cache_pb2.ChunkMeta | None = None
        self._pieces: list[bytes] = []
        self._num_received = 0
        self._crc = 0

    def feed(self, frame: cache_pb2.ChunkFrame) -> None:
        kind = frame.WhichOneof("frame")
        if kind == "header":
            self._start(frame.header.meta)
        elif kind == "data":
            self._append(frame.data)
        else:
            raise InvalidCacheRequest("a ChunkFrame must carry a header or data")

    def finish(self) -> list[IncomingChunk]:
        self._require_complete()
        return self.chunks

    def _start(self, meta: cache_pb2.ChunkMeta) -> None:
        self._require_complete()
        check_digest(meta.key, "ChunkMeta.key")
        check_digest(meta.namespace, "ChunkMeta.namespace")
        if meta.content_key:
            check_digest(meta.content_key, "ChunkMeta.content_key")
        check_continuation(meta.parent_key, meta.token_ids, "ChunkMeta")
        if meta.delete_count and not meta.delete_epoch_id:
            raise InvalidCacheRequest(f"chunk {meta.key.hex()[:16]}: ChunkMeta.delete_count needs the "
                                      f"delete_epoch_id of the same Lookup reply")
        check_blob_fits(meta.key, meta.size_bytes, self.max_blob_bytes)
        self._check_stream_bounds(meta.size_bytes)
        self._meta, self._pieces, self._num_received, self._crc = meta, [], 0, 0
        self._maybe_complete()

    def _check_stream_bounds(self, size_bytes: int) -> None:
        if self.max_chunks is not None and len(self.chunks) + 1 > self.max_chunks:
            raise StoreStreamOverLimit(f"this Store stream carries more than {self.max_chunks} chunks "
                                      f"(--max-store-chunks): split it into several Store calls")
        self._num_declared_bytes += size_bytes
        if self.max_stream_bytes is not None and self._num_declared_bytes > self.max_stream_bytes:
            raise StoreStreamOverLimit(f"this Store stream carries more than {self.max_stream_bytes} blob bytes "
                                      f"(--max-store-bytes; the daemon holds a stream in memory until it ends): "
                                      f"split it into several Store calls")

    def _append(self, data: bytes) -> None:
        if self._meta is None:
            raise InvalidCacheRequest("a data frame came before any header frame")
        if len(data) > MAX_FRAME_BYTES:
            raise InvalidCacheRequest(f"a data frame holds {len(data)} bytes, more than {MAX_FRAME_BYTES}")
        self._num_received += len(data)
        if self._num_received > self._meta.size_bytes:
            raise InvalidCacheRequest(f"chunk {self._meta.key.hex()[:16]}: data frames carry more than its "
                                 f"size_bytes={self._meta.size_bytes}")
        self._pieces.append(data)
        self._crc = crc32(data, self._crc)
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        meta = self._meta
        if meta is None or self._num_received < meta.size_bytes:
            return
        if self._crc != meta.checksum:
            raise InvalidCacheRequest(f"chunk {meta.key.hex()[:16]}: CRC-32 of the data is {self._crc:#010x}, "
                                 f"the header says {meta.checksum:#010x}")
        self.chunks.append(IncomingChunk(
            key=ChunkKey(meta.key), namespace=meta.namespace, content_key=meta.content_key,
            num_tokens=meta.num_tokens, checksum=meta.checksum, pinned=meta.pinned, blob=b"".join(self._pieces),
            parent_key=meta.parent_key, token_ids=meta.token_ids,
            writer=WriterEpoch(meta.delete_epoch_id, meta.delete_count) if meta.delete_epoch_id else None,
        ))
        self._meta, self._pieces = None, []

    def _require_complete(self) -> None:
        if self._meta is not None:
            raise InvalidCacheRequest(f"chunk {self._meta.key.hex()[:16]} ended after {self._num_received} of "
                                 f"its {self._meta.size_bytes} bytes")
