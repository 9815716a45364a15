"""The cache daemon's chunk streams on the client side: Store frames out, Fetch frames back into blobs."""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator

from inference_service.store.protocol import StoreItem, StoreUnavailable, pack_token_ids
from kvboost_common.checksum import crc32
from kvboost_common.frames import MAX_FRAME_BYTES
from kvboost.v1 import cache_pb2

logger = logging.getLogger(__name__)


def iter_store_frames(items: Iterable[StoreItem]) -> Iterator[cache_pb2.ChunkFrame]:
    """For each item a header frame (metadata, size, CRC-32), then data frames of at most 1 MiB."""
    for item in items:
        meta = cache_pb2.ChunkMeta(
            key=item.key, namespace=item.namespace, content_key=item.content_key or b"",
            num_tokens=item.num_tokens, size_bytes=len(item.blob), checksum=crc32(item.blob), pinned=item.pin,
        )
        if item.parent_key and item.token_ids:
            meta.parent_key, meta.token_ids = item.parent_key, pack_token_ids(item.token_ids)
        if item.delete_epoch is not None:
            meta.delete_epoch_id, meta.delete_count = item.delete_epoch.id, item.delete_epoch.count
        yield cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=meta))
        view = memoryview(item.blob)
        for start in range(0, len(view), MAX_FRAME_BYTES):
            yield cache_pb2.ChunkFrame(data=bytes(view[start:start + MAX_FRAME_BYTES]))


def reassemble_chunks(frames: Iterable[cache_pb2.ChunkFrame], keys: list[bytes],
                      on_corrupt: Callable[[bytes], None] | None = None) -> Iterator[tuple[bytes, bytes | None]]:
    """Turns a Fetch stream back into (key, blob) pairs in request order.

    A key that is absent, or whose bytes fail the CRC-32 in its header, comes back as None (a miss);
    on_corrupt(key) hears of the latter. Raises StoreUnavailable when the stream breaks the contract
    (wrong order, short data, missing keys).
    """
    frames = iter(frames)
    for expected_key in keys:
        header = next(frames, None)
        if header is None or header.WhichOneof("frame") != "header":
            raise StoreUnavailable(f"Fetch stream ended or sent data where the header of {expected_key.hex()[:16]} belongs")
        meta = header.header.meta
        if meta.key != expected_key:
            raise StoreUnavailable(f"Fetch stream sent {meta.key.hex()[:16]} where {expected_key.hex()[:16]} belongs")
        if not header.header.found:
            yield expected_key, None
            continue
        blob = _read_blob(frames, meta.size_bytes, expected_key)
        if crc32(blob) != meta.checksum:
            logger.warning("chunk %s failed its CRC-32: treated as a miss, reported", expected_key.hex()[:16])
            if on_corrupt is not None:
                on_corrupt(expected_key)
            yield expected_key, None
            continue
        yield expected_key, blob


def _read_blob(frames: Iterator[cache_pb2.ChunkFrame], size_bytes: int, key: bytes) -> bytes:
    parts: list[bytes] = []
    received = 0
    while received < size_bytes:
        frame = next(frames, None)
        if frame is None or frame.WhichOneof("frame") != "data":
            raise StoreUnavailable(f"chunk {key.hex()[:16]} stopped after {received} of {size_bytes} bytes")
        parts.append(frame.data)
        received += len(frame.data)
    if received != size_bytes:
        raise StoreUnavailable(f"chunk {key.hex()[:16]} sent {received} bytes, its header said {size_bytes}")
    return b"".join(parts)
