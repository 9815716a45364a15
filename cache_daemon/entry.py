"""What the daemon knows about one stored chunk besides its bytes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

from cache_daemon.deletes import WriterEpoch

# A stored chunk's prefix key: the LMDB key of its blob and metadata (32 raw bytes).
ChunkKey = NewType("ChunkKey", bytes)

DIGEST_SIZE = 32
# A fresh chunk counts as used once, so it ranks with other one-off chunks by recency.
INITIAL_FREQUENCY = 1.0


@dataclass(slots=True, frozen=True)
class Entry:
    """Metadata of one stored chunk; `frequency` is the decayed hit count as of `last_access`."""

    namespace: bytes
    content_key: bytes  # b"" when the chunk is not content-addressed
    num_tokens: int
    size_bytes: int
    checksum: int  # zlib.crc32 of the whole blob
    frequency: float
    last_access: float  # seconds since the epoch
    pinned: bool = False
    # The chunk's row in the daemon's in-memory eviction columns (cache_daemon/index.py), kept in
    # LMDB with the rest so a restart needs no key -> row map in RAM; -1 until the cache gives one.
    slot: int = -1

    def __post_init__(self) -> None:
        assert len(self.namespace) == DIGEST_SIZE, f"namespace must be {DIGEST_SIZE} bytes, got {len(self.namespace)}"
        assert len(self.content_key) in (0, DIGEST_SIZE), f"content key must be empty or {DIGEST_SIZE} bytes"
        assert self.size_bytes >= 0, f"size_bytes must be >= 0, got {self.size_bytes}"
        assert 0 <= self.checksum < 2**32, f"checksum must be a CRC-32, got {self.checksum}"
        assert self.frequency >= 0, f"frequency must be >= 0, got {self.frequency}"
        assert -1 <= self.slot < 2**31, f"slot must be -1 or a row number, got {self.slot}"


@dataclass(slots=True, frozen=True)
class IncomingChunk:
    """A chunk received by Store, its blob whole and checked against its CRC-32."""

    key: ChunkKey
    namespace: bytes
    content_key: bytes
    num_tokens: int
    checksum: int
    pinned: bool
    blob: bytes
    # The prefix key this chunk chains from and its token ids (packed uint32): indexed as a continuation of
    # that parent when both are given (see ChunkCache.continuation).
    parent_key: bytes = b""
    token_ids: bytes = b""
    # The delete epoch its writer computed it after (Store's ChunkMeta.delete_epoch_id / delete_count): a Delete the
    # writer had not seen that names it keeps it out (DeleteLog.supersedes). None: stored as always.
    writer: WriterEpoch | None = None

    def __post_init__(self) -> None:
        assert len(self.key) == DIGEST_SIZE, f"key must be {DIGEST_SIZE} bytes, got {len(self.key)}"

    def to_entry(self, now: float, slot: int = -1) -> Entry:
        return Entry(namespace=self.namespace, content_key=self.content_key, num_tokens=self.num_tokens,
                     size_bytes=len(self.blob), checksum=self.checksum, frequency=INITIAL_FREQUENCY,
                     last_access=now, pinned=self.pinned, slot=slot)
