"""The chunk cache: budget, eviction, write-behind frequencies and integrity on top of the store."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from cache_daemon import eviction
from kvboost_common.checksum import crc32
from cache_daemon.entry import ChunkKey, Entry, IncomingChunk
from cache_daemon.errors import BudgetExceeded, NotFound, check_blob_fits
from cache_daemon.index import EntryIndex, NamespaceUsage
from cache_daemon.store import LmdbStore, Put

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class LookupResult:
    prefix_hit: list[bool]
    prefix_run: int
    content_hits: list[tuple[int, ChunkKey]]  # (index into the prefix keys, stored key)
    partial_index: int | None = None  # index of the first stored partial key; None: none is stored


@dataclass(slots=True, frozen=True)
class PutResult:
    stored: int
    already_present: int
    evicted: int  # stored chunks evicted, plus incoming chunks that did not fit beside pinned ones
    bytes_stored: int


@dataclass(slots=True, frozen=True)
class DeleteResult:
    deleted: int
    bytes_freed: int


@dataclass(slots=True, frozen=True)
class PinResult:
    updated: int
    missing: list[ChunkKey]


@dataclass(slots=True)
class Counters:
    """Since start (not persisted)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupted: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass(slots=True, frozen=True)
class CacheStats:
    num_entries: int
    num_bytes: int
    max_bytes: int
    map_size: int
    num_unflushed_hits: int
    counters: Counters
    namespaces: dict[bytes, NamespaceUsage] = field(default_factory=dict)


class ChunkCache:
    """Thread-safe. `_write_lock` serializes LMDB writes; the index changes only right after a
    write, under both locks. So a holder of `_write_lock` reads the index freely, and everyone
    else reads it under `_lock`, which is never held across I/O."""

    def __init__(self, store: LmdbStore, max_bytes: int, half_life: float,
                 clock: Callable[[], float] = time.time) -> None:
        assert max_bytes > 0, f"max_bytes must be positive, got {max_bytes}"
        assert half_life > 0, f"half_life must be positive (math.inf for no decay), got {half_life}"
        self.store = store
        self.max_bytes = max_bytes
        self.half_life = half_life
        self._clock = clock
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._index = EntryIndex(store.load_entries())
        self._pending_hits: Counter[ChunkKey] = Counter()
        self._counters = Counters()
        # A restart with a smaller --max-bytes evicts down to the new budget at once.
        self.put_many([])

    @classmethod
    def open(cls, data_dir: Path, map_size: int, max_bytes: int, half_life: float) -> ChunkCache:
        return cls(LmdbStore(data_dir, map_size), max_bytes, half_life)

    def entry(self, key: ChunkKey) -> Entry | None:
        with self._lock:
            return self._index.get(key)

    def lookup(self, namespace: bytes, prefix_keys: Sequence[bytes], content_keys: Sequence[bytes],
               partial_keys: Sequence[bytes] = ()) -> LookupResult:
        """Which keys hit; the leading prefix run, the content hits and the first stored partial key
        (partial_keys are tried in order) count toward frequencies."""
        with self._lock:
            prefix_hit = [self._holds(key, namespace) for key in prefix_keys]
            partial_index = next((i for i, key in enumerate(partial_keys) if self._holds(key, namespace)), None)
        prefix_run = prefix_hit.index(False) if False in prefix_hit else len(prefix_hit)
        content_hits = self._content_hits(namespace, prefix_hit, content_keys)
        partial_hits = [] if partial_index is None else [partial_keys[partial_index]]
        with self._lock:
            self._pending_hits.update(prefix_keys[:prefix_run])
            self._pending_hits.update(key for _, key in content_hits)
            self._pending_hits.update(partial_hits)
            num_hits = sum(prefix_hit) + len(content_hits) + len(partial_hits)
            self._counters.hits += num_hits
            self._counters.misses += len(prefix_keys) + (1 if partial_keys else 0) - num_hits
        return LookupResult(prefix_hit=prefix_hit, prefix_run=prefix_run, content_hits=content_hits,
                            partial_index=partial_index)

    def _holds(self, key: bytes, namespace: bytes) -> bool:
        entry = self._index.get(ChunkKey(key))
        return entry is not None and entry.namespace == namespace

    def _content_hits(self, namespace: bytes, prefix_hit: list[bool],
                      content_keys: Sequence[bytes]) -> list[tuple[int, ChunkKey]]:
        indices = [index for index, key in enumerate(content_keys) if key and not prefix_hit[index]]
        if not indices:
            return []
        matches = self.store.content_matches([content_keys[index] for index in indices])
        hits = []
        with self._lock:
            for index, stored_keys in zip(indices, matches):
                candidates = [key for key in stored_keys if self._holds(key, namespace)]
                if candidates:
                    # Several contexts may hold these tokens: serve the one kept most reliably.
                    best = max(candidates, key=lambda key: eviction.retention_score(self._index.entries[key],
                                                                                     self.half_life))
                    hits.append((index, best))
        return hits

    def read(self, key: ChunkKey, copy_out: Callable[[memoryview], T]) -> tuple[Entry, T] | None:
        """The chunk's metadata and copy_out(blob view), or None when absent or corrupted."""
        entry = self.entry(key)
        result = None
        if entry is not None:
            result = self.store.read_blob(key, lambda view: _verified(view, entry, copy_out))
            if result is _CORRUPTED:
                self._drop_corrupted(key, entry)
                result = None
        with self._lock:
            if result is None:
                self._counters.misses += 1
                return None
            self._counters.hits += 1
            self._counters.bytes_read += entry.size_bytes
        return entry, result

    def _drop_corrupted(self, key: ChunkKey, entry: Entry) -> None:
        with self._write_lock:
            current = self.entry(key)
            # The key may have been evicted and stored again since `entry` was read.
            if current is None or (current.checksum, current.size_bytes) != (entry.checksum, entry.size_bytes):
                return
            self._delete_locked([key])
            with self._lock:
                self._counters.corrupted += 1
        logger.error("chunk %s failed its CRC-32 check (%d bytes expected): deleted, served as a miss",
                     key.hex(), entry.size_bytes)

    def put_many(self, chunks: Sequence[IncomingChunk]) -> PutResult:
        """Commits new chunks in one transaction, evicting to stay inside the budget. Keys already
        stored are left as they are (bytes, frequency and pin)."""
        for chunk in chunks:
            check_blob_fits(chunk.key, len(chunk.blob), self.max_bytes)
        with self._write_lock:
            new_chunks = _first_of_each_key(chunk for chunk in chunks if chunk.key not in self._index)
            plan = eviction.plan_admission(self._index.entries, [(c.key, len(c.blob)) for c in new_chunks],
                                           self.max_bytes, self.half_life)
            if new_chunks and not plan.admitted:
                raise BudgetExceeded(f"pinned chunks fill the budget --max-bytes={self.max_bytes}: "
                                     f"no room for {len(new_chunks)} new chunks")
            now = self._clock()
            admitted = set(plan.admitted)
            puts = [(c.key, c.to_entry(now), c.blob) for c in new_chunks if c.key in admitted]
            self._commit(puts=puts, deletes=[(key, self._index.entries[key]) for key in plan.victims])
            bytes_stored = sum(entry.size_bytes for _, entry, _ in puts)
            num_evicted = len(plan.victims) + len(plan.rejected)
            with self._lock:
                self._counters.evictions += num_evicted
                self._counters.bytes_written += bytes_stored
        if num_evicted:
            logger.info("evicted %d chunks (%d bytes) and dropped %d incoming ones to stay inside %d bytes",
                        len(plan.victims), plan.bytes_freed, len(plan.rejected), self.max_bytes)
        return PutResult(stored=len(puts), already_present=len(chunks) - len(new_chunks), evicted=num_evicted,
                         bytes_stored=bytes_stored)

    def delete_keys(self, keys: Sequence[ChunkKey], corrupted: bool = False) -> DeleteResult:
        """corrupted: a reader found these blobs failing their checksum; they count in Stats.corrupted."""
        with self._write_lock:
            result = self._delete_locked(keys)
            if corrupted and result.deleted:
                with self._lock:
                    self._counters.corrupted += result.deleted
        if corrupted and result.deleted:
            logger.error("%d chunks reported corrupt by a reader (%s): deleted", result.deleted,
                         ", ".join(key.hex()[:16] for key in keys))
        return result

    def delete_namespace(self, namespace: bytes) -> DeleteResult:
        with self._write_lock:
            keys = self._index.keys_in_namespace(namespace)
            if not keys:
                raise NotFound(f"namespace {namespace.hex()[:16]} has no entries")
            return self._delete_locked(keys)

    def _delete_locked(self, keys: Sequence[ChunkKey]) -> DeleteResult:
        targets = {key: self._index.entries[key] for key in keys if key in self._index}
        self._commit(deletes=list(targets.items()))
        return DeleteResult(deleted=len(targets), bytes_freed=sum(entry.size_bytes for entry in targets.values()))

    def set_pinned(self, keys: Sequence[ChunkKey], pinned: bool) -> PinResult:
        """Raises NotFound when none of the keys is stored."""
        with self._write_lock:
            missing = [key for key in keys if key not in self._index]
            updates = {key: dataclasses.replace(self._index.entries[key], pinned=pinned)
                       for key in keys if key in self._index}
            if not updates:
                raise NotFound(f"none of the {len(keys)} keys is stored")
            self._commit(updates=list(updates.items()))
        return PinResult(updated=len(updates), missing=missing)

    def flush_hits(self) -> int:
        """Applies the hits recorded since the last flush to the frequencies, in one transaction."""
        with self._write_lock:
            with self._lock:
                pending, self._pending_hits = self._pending_hits, Counter()
            now = self._clock()
            # A key evicted after its lookup has no entry left to update.
            updates = [(key, eviction.record_hits(self._index.entries[key], num_hits, now, self.half_life))
                       for key, num_hits in pending.items() if key in self._index]
            try:
                self._commit(updates=updates)
            except Exception:
                with self._lock:
                    self._pending_hits.update(pending)  # kept for the next flush
                raise
        return len(updates)

    def _commit(self, puts: Sequence[Put] = (), updates: Sequence[tuple[ChunkKey, Entry]] = (),
                deletes: Sequence[tuple[ChunkKey, Entry]] = ()) -> None:
        """Writes one transaction, then mirrors it in the index. The caller holds _write_lock."""
        if not (puts or updates or deletes):
            return
        self.store.write(puts=puts, updates=updates, deletes=deletes)
        with self._lock:
            for key, _ in deletes:
                self._index.remove(key)
                self._pending_hits.pop(key, None)
            for key, entry, _ in puts:
                self._index.add(key, entry)
            for key, entry in updates:
                self._index.replace(key, entry)

    def stats(self) -> CacheStats:
        map_size = self.store.map_size
        with self._lock:
            return CacheStats(num_entries=len(self._index), num_bytes=self._index.num_bytes,
                              max_bytes=self.max_bytes, map_size=map_size,
                              num_unflushed_hits=sum(self._pending_hits.values()),
                              counters=dataclasses.replace(self._counters), namespaces=self._index.usage())

    def close(self) -> None:
        """Flushes frequencies, syncs and closes the store."""
        self.flush_hits()
        self.store.sync()
        self.store.close()


class _Corrupted:
    """Marker returned from inside the read txn when the blob fails its check."""


_CORRUPTED = _Corrupted()


def _verified(view: memoryview, entry: Entry, copy_out: Callable[[memoryview], T]) -> T | _Corrupted:
    if len(view) != entry.size_bytes or crc32(view) != entry.checksum:
        return _CORRUPTED
    return copy_out(view)


def _first_of_each_key(chunks) -> list[IncomingChunk]:
    seen: dict[ChunkKey, IncomingChunk] = {}
    for chunk in chunks:
        seen.setdefault(chunk.key, chunk)
    return list(seen.values())
