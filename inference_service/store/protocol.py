"""The engine's view of a chunk store (lookup, fetch, store) and the always-miss store."""
from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

# Blob bytes per store call of a write-back or warm-up (one Store stream): the daemon's default --max-store-bytes
# (its --max-bytes, 1 GiB) leaves room for it, and the service holds at most this much encoded at once.
DEFAULT_MAX_STREAM_BYTES = 256 << 20


class StoreUnavailable(Exception):
    """The store cannot be reached; the engine serves the request without it (degraded)."""


class StoreTimeout(StoreUnavailable):
    """One transfer (a Fetch or Store stream) ran past its deadline: the store is still reachable; what the
    transfer gave before stays good, the rest is computed (the request is not degraded)."""


@dataclass(slots=True, frozen=True)
class DeleteEpoch:
    """Delete calls a store had completed when it answered a Lookup (count), within one start of that store (id):
    while the epoch is unchanged, nothing a Lookup confirmed then has been deleted since (eviction does not count).
    asked: the Lookup's place in the order this process asked them in (lookup_order): of two answers from different
    starts, the one asked later is the current start's. Not part of the epoch's identity."""

    id: str
    count: int
    asked: int = field(default=0, compare=False)


_lookups = itertools.count(1)


def lookup_order() -> int:
    """The next number in the order this process asks Lookups in (DeleteEpoch.asked); taken before the Lookup is sent."""
    return next(_lookups)  # itertools.count's next is atomic under the GIL


@dataclass(slots=True, frozen=True)
class StoreLookup:
    prefix_run: int  # how many leading prefix keys hit, in order
    content_hits: dict[int, bytes] = field(default_factory=dict)  # chunk index -> stored prefix key
    partial_index: int | None = None  # index of the first stored partial key asked for; None: none
    # The stored continuation of the asked parent sharing the most leading tokens (None: none), and how many.
    continuation_key: bytes | None = None
    continuation_tokens: int = 0
    # Asked with after_run (AfterRun): True when the store answered what continues the run it found (prefix_run):
    # the continuation above, and the longest stored partial chunk after the run (its key and tokens; None: none).
    # False: a store that does not answer it (an older daemon); the caller asks a second time.
    continued: bool = False
    partial_key: bytes | None = None
    partial_tokens: int = 0
    delete_epoch: DeleteEpoch | None = None  # None: a store that keeps none (an older daemon)

    def __post_init__(self) -> None:
        assert self.prefix_run >= 0, f"prefix_run must be >= 0, got {self.prefix_run}"
        assert (self.partial_key is None) == (self.partial_tokens == 0), "a partial chunk holds tokens"
        assert (self.continuation_key is None) == (self.continuation_tokens == 0), "a continuation shares tokens"


@dataclass(slots=True, frozen=True)
class ContinuationQuery:
    """Reuse inside a chunk: the stored chunk chained from `parent` whose leading tokens agree longest with
    token_ids (the prompt's tokens after its run of whole chunks)."""

    parent: bytes
    token_ids: tuple[int, ...]

    def packed(self) -> bytes:
        return pack_token_ids(self.token_ids)


@dataclass(slots=True, frozen=True)
class AfterRun:
    """One Lookup for the run and what continues it: tokens_after[r] (packed ids) are the tokens a chunk continuing
    a run of r whole chunks may cover (chunk r's but its last; the tail after the last chunk)."""

    tokens_after: tuple[bytes, ...]


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Little-endian uint32 each: the wire form of token ids in the cache protocol."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    shared = 0
    for x, y in zip(a, b):
        if x != y:
            break
        shared += 1
    return shared


@dataclass(slots=True, frozen=True)
class StoreItem:
    key: bytes  # the chunk's prefix key
    namespace: bytes
    content_key: bytes | None
    num_tokens: int
    blob: bytes
    pin: bool = False
    # The prefix key this chunk chains from and its token ids: the daemon indexes the chunk as a continuation
    # of that parent (reuse inside a chunk). Empty: not indexed.
    parent_key: bytes = b""
    token_ids: tuple[int, ...] = ()
    # The delete epoch of the Lookup its K/V were computed after: the daemon leaves the chunk out when a Delete that
    # epoch does not count names it (StoreReply.superseded). None: stored whatever was deleted (a warm-up).
    delete_epoch: DeleteEpoch | None = None

    def __post_init__(self) -> None:
        assert self.num_tokens > 0, f"a stored chunk holds tokens, got {self.num_tokens}"


class ChunkStore(Protocol):
    degraded: bool  # True while the backend is unreachable
    # Optional, read with getattr(cache, "verifies_blobs", False): True when fetch already checked every
    # blob it returns against a checksum taken over the same bytes when they were stored, so the engine
    # need not run the blob's own CRC-32 a second time.
    # Optional, read with getattr(cache, "read_mode", ""): how blobs are read, "locked_map", "stream" or
    # "remote" (ServiceStatsReply.read_mode).

    def lookup(self, namespace: bytes, prefix_keys: list[bytes], content_keys: list[bytes] | None = None,
               partial_keys: list[bytes] | None = None, continuation: ContinuationQuery | None = None,
               after_run: AfterRun | None = None) -> StoreLookup:
        """Which chunks are stored; moves no blob bytes. partial_keys are tried in order, the first stored
        one is reported; continuation: the stored chunk sharing the most leading tokens (a store that keeps
        no such index answers none). Raises StoreUnavailable."""
        ...

    def fetch(self, keys: list[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, blob) in the order asked; None for a key that is not stored. Raises StoreUnavailable.

        A blob may be any bytes-like object; a writable one (bytearray) lets decoding skip a copy.
        """
        ...

    def store(self, items: list[StoreItem]) -> int:
        """Stores the items; returns how many are stored (already present ones included). Raises StoreUnavailable."""
        ...

    def unpin(self, keys: list[bytes]) -> int:
        """Makes stored chunks evictable again; returns how many of the keys are stored. Raises StoreUnavailable."""
        ...


class NullStore:
    """Stores nothing, finds nothing: BASELINE, and the stand-in while no store is configured."""

    degraded = False

    def lookup(self, namespace: bytes, prefix_keys: list[bytes], content_keys: list[bytes] | None = None,
               partial_keys: list[bytes] | None = None, continuation: ContinuationQuery | None = None,
               after_run: AfterRun | None = None) -> StoreLookup:
        return StoreLookup(0, {}, continued=after_run is not None)

    def fetch(self, keys: list[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
        return iter([(key, None) for key in keys])

    def store(self, items: list[StoreItem]) -> int:
        return 0

    def unpin(self, keys: list[bytes]) -> int:
        return 0
