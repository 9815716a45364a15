"""The engine's view of a chunk store: lookup, fetch, store; an in-process dict store and an always-miss one."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator, Protocol


class CacheUnavailable(Exception):
    """The store cannot be reached; the engine serves the request without it (degraded)."""


@dataclass(slots=True, frozen=True)
class LookupResult:
    prefix_run: int  # how many leading prefix keys hit, in order
    content_hits: dict[int, bytes] = field(default_factory=dict)  # chunk index -> stored prefix key

    def __post_init__(self) -> None:
        assert self.prefix_run >= 0, f"prefix_run must be >= 0, got {self.prefix_run}"


@dataclass(slots=True, frozen=True)
class StoreItem:
    key: bytes  # the chunk's prefix key
    namespace: bytes
    content_key: bytes | None
    num_tokens: int
    blob: bytes
    pin: bool = False

    def __post_init__(self) -> None:
        assert self.num_tokens > 0, f"a stored chunk holds tokens, got {self.num_tokens}"


class ChunkCache(Protocol):
    degraded: bool  # True while the backend is unreachable
    # Optional, read with getattr(cache, "verifies_blobs", False): True when fetch already checked every
    # blob it returns against a checksum taken over the same bytes when they were stored, so the engine
    # need not run the blob's own CRC-32 a second time.

    def lookup(self, namespace: bytes, prefix_keys: list[bytes], content_keys: list[bytes] | None = None) -> LookupResult:
        """Which chunks are stored; moves no blob bytes. Raises CacheUnavailable."""
        ...

    def fetch(self, keys: list[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, blob) in the order asked; None for a key that is not stored. Raises CacheUnavailable.

        A blob may be any bytes-like object; a writable one (bytearray) lets decoding skip a copy.
        """
        ...

    def store(self, items: list[StoreItem]) -> int:
        """Stores the items; returns how many are stored (already present ones included). Raises CacheUnavailable."""
        ...


@dataclass(slots=True)
class _Entry:
    namespace: bytes
    content_key: bytes | None
    num_tokens: int
    blob: bytearray  # writable, so decoding shares it instead of copying; never written after store
    pin: bool


class InProcessCache:
    """A dict-backed ChunkCache for tests and the in-process benchmark; thread-safe, unbounded."""

    def __init__(self) -> None:
        self.degraded = False
        self._entries: dict[bytes, _Entry] = {}
        self._content_index: dict[bytes, bytes] = {}  # content key -> newest prefix key stored with it
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def lookup(self, namespace: bytes, prefix_keys: list[bytes], content_keys: list[bytes] | None = None) -> LookupResult:
        with self._lock:
            run = 0
            while run < len(prefix_keys) and self._holds(namespace, prefix_keys[run]):
                run += 1
            content_hits: dict[int, bytes] = {}
            for index, content_key in enumerate(content_keys or ()):
                stored = self._content_index.get(content_key)
                if index >= run and stored is not None and self._holds(namespace, stored):
                    content_hits[index] = stored
        return LookupResult(run, content_hits)

    def _holds(self, namespace: bytes, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.namespace == namespace

    def fetch(self, keys: list[bytes]) -> Iterator[tuple[bytes, bytearray | None]]:
        with self._lock:
            blobs = [(key, entry.blob if (entry := self._entries.get(key)) else None) for key in keys]
        yield from blobs

    def store(self, items: list[StoreItem]) -> int:
        with self._lock:
            for item in items:
                self._entries[item.key] = _Entry(
                    item.namespace, item.content_key, item.num_tokens, bytearray(item.blob), item.pin)
                if item.content_key is not None:
                    self._content_index[item.content_key] = item.key
        return len(items)

    def delete(self, keys: list[bytes]) -> None:
        """Drops entries (tests use it to simulate eviction)."""
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)


class NullCache:
    """Stores nothing, finds nothing: BASELINE, and the stand-in while no store is configured."""

    degraded = False

    def lookup(self, namespace: bytes, prefix_keys: list[bytes], content_keys: list[bytes] | None = None) -> LookupResult:
        return LookupResult(0, {})

    def fetch(self, keys: list[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
        return iter([(key, None) for key in keys])

    def store(self, items: list[StoreItem]) -> int:
        return 0
