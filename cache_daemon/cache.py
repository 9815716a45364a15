"""The chunk cache: budget, eviction, write-behind frequencies and integrity on top of the store."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

import numpy as np

from cache_daemon import eviction
from kvboost_common.checksum import crc32
from cache_daemon.deletes import DeleteLog
from cache_daemon.entry import ChunkKey, Entry, IncomingChunk
from cache_daemon.errors import BudgetExceeded, NotFound, check_blob_fits
from cache_daemon.events import DEFAULT_HISTORY, ChunkEvent, EventJournal, EventKind
from cache_daemon.index import EntryIndex, NamespaceUsage, Share
from cache_daemon.store import Continuation, HeldChunk, LmdbStore, Put

logger = logging.getLogger(__name__)

NAMESPACE_OWNER_PREFIX = b"namespace_owner:"  # info DB: + stored namespace -> tenant name
# Continuations indexed per parent key; past it, the least valuable (eviction's retention score) leaves the
# index (its blob stays, still found by its own key), so a hot parent's index cannot grow without limit.
MAX_CHILDREN = 32

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
    superseded: int = 0  # incoming chunks a Delete their writer had not seen names (DeleteLog.supersedes)


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
    superseded: int = 0  # incoming chunks a Delete their writer had not seen named (not stored)


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
    """Thread-safe. LMDB is the truth for what is stored: Lookup, Fetch and `entry` read it in
    their own read transactions and take no lock but `_lock`, which only guards the pending hits
    and counters and is never held across I/O or planning. Writers (Store, Delete, Pin, the hit
    flush) run one at a time under `_write_lock`; they plan from the index, commit, then apply
    the change to the index under `_index_lock` (held for that O(k log n) update, and by stats).
    The index loads from LMDB's metadata after the constructor returns when
    `load_in_background`; writers wait for it, readers do not need it.

    Every change of what LMDB holds is published to `events` after its commit and before
    `_write_lock` is released, so events are in commit order and never name a chunk before it
    can be read."""


    def __init__(self, store: LmdbStore, max_bytes: int, half_life: float,
                 clock: Callable[[], float] = time.time, load_in_background: bool = False,
                 share_budgets: Mapping[str, int] | None = None, events: EventJournal | None = None) -> None:
        """share_budgets: tenant -> max_bytes, the tenants whose chunks are evicted within a share
        of their own (a tenant owns the namespaces recorded by `record_owners`). events: where
        changes are published (a journal of the default history when not given)."""
        assert max_bytes > 0, f"max_bytes must be positive, got {max_bytes}"
        assert half_life > 0, f"half_life must be positive (math.inf for no decay), got {half_life}"
        self.store = store
        self.max_bytes = max_bytes
        self.half_life = half_life
        self._clock = clock
        self._lock = threading.Lock()
        self._index_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._index = EntryIndex(half_life, share_budgets)
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._pending_hits: Counter[ChunkKey] = Counter()
        self._counters = Counters()
        self.events = events if events is not None else EventJournal()
        self.deletes = DeleteLog()  # the delete epoch, and the Deletes a Store is checked against (in _write_lock)
        if load_in_background:
            threading.Thread(target=self._load, name="index-loader", daemon=True).start()
        else:
            self._load()
            if self._load_error is not None:
                raise self._load_error

    @classmethod
    def open(cls, data_dir: Path, map_size: int, max_bytes: int, half_life: float,
             share_budgets: Mapping[str, int] | None = None, event_history: int = DEFAULT_HISTORY) -> ChunkCache:
        """Serves reads at once; writes wait until the index is loaded (about 1 s per million chunks)."""
        return cls(LmdbStore(data_dir, map_size), max_bytes, half_life, load_in_background=True,
                   share_budgets=share_budgets, events=EventJournal(event_history))

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            for namespace, tenant in self.store.info_items(NAMESPACE_OWNER_PREFIX).items():
                with self._index_lock:
                    self._index.assign_owner(namespace, tenant.decode())
            for key_rows, metas in self.store.scan_meta():
                with self._index_lock:
                    self._index.load(key_rows, metas)
            with self._index_lock:
                self._index.finish_load()
            self._loaded.set()
            # A restart with a smaller --max-bytes evicts down to the new budget at once.
            self.put_many([])
        except BaseException as error:  # writers raise it; reads keep working from LMDB
            logger.exception("loading the eviction index failed: Store, Delete and Pin are refused")
            self._load_error = error
            self._loaded.set()
            return
        logger.info("eviction index loaded: %d chunks, %d bytes in %.2f s", len(self._index),
                    self._index.num_bytes, time.perf_counter() - started)

    def wait_until_loaded(self, timeout_s: float | None = None) -> bool:
        return self._loaded.wait(timeout_s)

    @contextmanager
    def _writing(self) -> Iterator[None]:
        self._loaded.wait()
        if self._load_error is not None:
            raise RuntimeError("the eviction index did not load; see the daemon's log") from self._load_error
        with self._write_lock:
            yield

    def entry(self, key: ChunkKey) -> Entry | None:
        return self.store.get_entries([key])[0]

    def lookup(self, namespace: bytes, prefix_keys: Sequence[bytes], content_keys: Sequence[bytes],
               partial_keys: Sequence[bytes] = ()) -> LookupResult:
        """Which keys hit; the leading prefix run, the content hits and the first stored partial key
        (partial_keys are tried in order) count toward frequencies."""
        result = self.probe(namespace, prefix_keys, content_keys, partial_keys)
        self.record_lookup(result, prefix_keys, partial_keys)
        return result

    def probe(self, namespace: bytes, prefix_keys: Sequence[bytes], content_keys: Sequence[bytes],
              partial_keys: Sequence[bytes] = ()) -> LookupResult:
        """What `lookup` answers, without counting anything."""
        prefix_hit = self.store.holding(prefix_keys, namespace)
        partial_held = self.store.holding(partial_keys, namespace) if partial_keys else []
        partial_index = partial_held.index(True) if True in partial_held else None
        prefix_run = prefix_hit.index(False) if False in prefix_hit else len(prefix_hit)
        content_hits = self._content_hits(namespace, prefix_hit, content_keys)
        return LookupResult(prefix_hit=prefix_hit, prefix_run=prefix_run, content_hits=content_hits,
                            partial_index=partial_index)

    def record_lookup(self, result: LookupResult, prefix_keys: Sequence[bytes], partial_keys: Sequence[bytes]) -> None:
        """Counts a probe's hits and misses, and its hits toward frequencies."""
        partial_hits = [] if result.partial_index is None else [partial_keys[result.partial_index]]
        with self._lock:
            self._pending_hits.update(prefix_keys[:result.prefix_run])
            self._pending_hits.update(key for _, key in result.content_hits)
            self._pending_hits.update(partial_hits)
            num_hits = sum(result.prefix_hit) + len(result.content_hits) + len(partial_hits)
            self._counters.hits += num_hits
            self._counters.misses += len(prefix_keys) + (1 if partial_keys else 0) - num_hits

    def _content_hits(self, namespace: bytes, prefix_hit: list[bool],
                      content_keys: Sequence[bytes]) -> list[tuple[int, ChunkKey]]:
        indices = [index for index, key in enumerate(content_keys) if key and not prefix_hit[index]]
        if not indices:
            return []
        matches = self.store.content_matches([content_keys[index] for index in indices])
        stored = self.store.get_entries([key for stored_keys in matches for key in stored_keys])
        entries = iter(stored)
        hits = []
        for index, stored_keys in zip(indices, matches):
            candidates = [(key, entry) for key, entry in zip(stored_keys, entries)
                          if entry is not None and entry.namespace == namespace]
            if candidates:
                # Several contexts may hold these tokens: serve the one kept most reliably.
                best, _ = max(candidates, key=lambda pair: eviction.retention_score(pair[1], self.half_life))
                hits.append((index, best))
        return hits

    def continuation(self, namespace: bytes, parent: bytes, token_ids: bytes) -> tuple[ChunkKey, int] | None:
        """The stored chunk of `namespace` indexed under `parent` whose leading token ids agree longest with
        token_ids (packed uint32), and how many agree (>= 1); None when none shares a first token. Ties go
        to the chunk eviction would keep longest, then to the one holding more tokens. Counts as a hit of
        that chunk."""
        children = self.store.children(parent)
        if not children or not token_ids:
            return None
        wanted = np.frombuffer(token_ids, dtype="<u4")
        best: tuple[int, float, int, ChunkKey] | None = None
        for (child, child_tokens), entry in zip(children, self.store.get_entries([key for key, _ in children])):
            if entry is None or entry.namespace != namespace:
                continue
            shared = _common_prefix(wanted, np.frombuffer(child_tokens, dtype="<u4"))
            if shared == 0:
                continue
            rank = (shared, eviction.retention_score(entry, self.half_life), len(child_tokens), child)
            if best is None or rank[:3] > best[:3]:
                best = rank
        with self._lock:
            if best is None:
                self._counters.misses += 1
                return None
            self._pending_hits.update([best[3]])
            self._counters.hits += 1
        return best[3], best[0]

    def read(self, key: ChunkKey, copy_out: Callable[[memoryview], T], verify: bool = True) -> tuple[Entry, T] | None:
        """The chunk's metadata and copy_out(blob view), or None when absent or (verify) corrupted.

        verify=False: the reader checks the blob against entry.checksum itself (and reports a bad one)."""
        check = _verified if verify else _sized
        found = self.store.read_chunk(key, lambda entry, view: (entry, check(view, entry, copy_out)))
        if found is not None and found[1] is _CORRUPTED:
            self._drop_corrupted(key, found[0])
            found = None
        with self._lock:
            if found is None:
                self._counters.misses += 1
                return None
            self._counters.hits += 1
            self._counters.bytes_read += found[0].size_bytes
        return found

    def _drop_corrupted(self, key: ChunkKey, entry: Entry) -> None:
        with self._writing():
            current = self.entry(key)
            # The key may have been evicted and stored again since `entry` was read.
            if current is None or (current.checksum, current.size_bytes) != (entry.checksum, entry.size_bytes):
                return
            self.events.publish(self._removal_events(EventKind.DELETED, self._delete_locked([key])))
            with self._lock:
                self._counters.corrupted += 1
        logger.error("chunk %s failed its CRC-32 check (%d bytes expected): deleted, served as a miss",
                     key.hex(), entry.size_bytes)

    def put_many(self, chunks: Sequence[IncomingChunk], kind: EventKind = EventKind.STORED) -> PutResult:
        """Commits new chunks in one transaction, evicting to stay inside the budget. Keys already
        stored are left as they are (bytes, frequency and pin). Costs O((new + evicted) log n).
        kind: how the new chunks are published (PROMOTED for copies out of L2)."""
        for chunk in chunks:
            check_blob_fits(chunk.key, len(chunk.blob), self.max_bytes)
        with self._writing():
            # Checked in the write lock, which every Delete's removal takes after it began in the DeleteLog.
            wanted = self.deletes.not_superseded(chunks)
            num_superseded = len(chunks) - len(wanted)
            unique = _first_of_each_key(wanted)
            stored = self.store.get_entries([chunk.key for chunk in unique])
            new_chunks = [chunk for chunk, entry in zip(unique, stored) if entry is None]
            index = self._index
            plan = self._plan_admission([(chunk.key, len(chunk.blob)) for chunk in new_chunks],
                                        [index.share_of_namespace(chunk.namespace) for chunk in new_chunks])
            victim_keys = [index.key_of(slot) for slot in plan.victims]
            victims = list(zip(victim_keys, self.store.get_entries(victim_keys)))
            assert all(entry is not None for _, entry in victims), "the index holds a chunk LMDB does not"
            now = self._clock()
            admitted = set(plan.admitted)
            to_put = [chunk for chunk in new_chunks if chunk.key in admitted]
            slots = index.reserve_slots(len(to_put))
            puts = [(chunk.key, chunk.to_entry(now, slot), chunk.blob) for chunk, slot in zip(to_put, slots)]
            continuations, unindexed = self._plan_continuations(to_put, {key for key, _ in victims})
            try:
                self._commit(puts=puts, deletes=victims, continuations=continuations, unindexed=unindexed)
            except BaseException:
                index.release_slots(slots)
                raise
            self.events.publish(self._removal_events(EventKind.EVICTED, victims) + [
                ChunkEvent(kind, chunk.namespace, chunk.key, chunk.content_key, chunk.num_tokens, chunk.parent_key, now)
                for chunk in to_put])
            bytes_stored = sum(entry.size_bytes for _, entry, _ in puts)
            num_evicted = len(plan.victims) + len(plan.rejected)
            with self._lock:
                self._counters.evictions += num_evicted
                self._counters.bytes_written += bytes_stored
                self._counters.superseded += num_superseded
        if num_evicted:
            logger.debug("evicted %d chunks (%d bytes) and dropped %d incoming ones to stay inside %d bytes",
                         len(plan.victims), plan.bytes_freed, len(plan.rejected), self.max_bytes)
        if num_superseded:
            logger.info("left out %d incoming chunks: a Delete their writer had not seen named them", num_superseded)
        return PutResult(stored=len(puts), already_present=len(wanted) - len(new_chunks), evicted=num_evicted,
                         bytes_stored=bytes_stored, superseded=num_superseded)

    def _plan_continuations(self, admitted: Sequence[IncomingChunk],
                            leaving: set[ChunkKey]) -> tuple[list[Continuation], list[ChunkKey]]:
        """The continuations to index for chunks being stored, and the children that leave the index to keep
        each parent at MAX_CHILDREN (the least valuable first; a new child counts as the most valuable).
        The caller holds _write_lock."""
        by_parent: dict[bytes, list[IncomingChunk]] = {}
        for chunk in admitted:
            if chunk.parent_key and chunk.token_ids:
                by_parent.setdefault(chunk.parent_key, []).append(chunk)
        continuations: list[Continuation] = []
        unindexed: list[ChunkKey] = []
        for parent, chunks in by_parent.items():
            chunks = chunks[-MAX_CHILDREN:]
            continuations += [(chunk.key, parent, chunk.token_ids) for chunk in chunks]
            existing = [key for key, _ in self.store.children(parent) if key not in leaving]
            excess = len(existing) + len(chunks) - MAX_CHILDREN
            if excess > 0:
                entries = self.store.get_entries(existing)
                ranked = sorted(zip(existing, entries), key=lambda pair: -1.0 if pair[1] is None else
                                eviction.retention_score(pair[1], self.half_life))
                unindexed += [key for key, _ in ranked[:excess]]
        return continuations, unindexed

    def _plan_admission(self, incoming: list[tuple[ChunkKey, int]],
                        shares: list[Share | None]) -> eviction.AdmissionPlan:
        """First each tenant share over its budget evicts its own chunks (never another tenant's),
        then the global budget applies to what the shares admitted. Raises BudgetExceeded when
        nothing incoming fits. The caller holds _write_lock."""
        index = self._index
        victims: list[int] = []
        rejected: set[ChunkKey] = set()
        full_shares: list[str] = []
        for share in index.shares.values():
            mine = [item for item, owner in zip(incoming, shares) if owner is share]
            if not mine and share.num_bytes <= share.max_bytes:
                continue
            plan = eviction.plan_admission_from_totals(share.num_bytes, share.pinned_bytes, index.iter_victims(share),
                                                       mine, share.max_bytes)
            if mine and not plan.admitted:
                full_shares.append(f"tenant {share.tenant}'s share max_bytes={share.max_bytes} "
                                   "(or a chunk is larger than that share)")
            victims += plan.victims
            rejected.update(plan.rejected)
        chosen = set(victims)
        freed = sum(index.sizes[slot] for slot in victims)
        plan = eviction.plan_admission_from_totals(
            index.num_bytes - freed, index.pinned_bytes,
            ((slot, size) for slot, size in index.iter_victims() if slot not in chosen),
            [item for item in incoming if item[0] not in rejected], self.max_bytes)
        if incoming and not plan.admitted:
            budgets = ", ".join(full_shares) or f"the budget --max-bytes={self.max_bytes}"
            raise BudgetExceeded(f"pinned chunks fill {budgets}: "
                                 f"no room for {len(incoming)} new chunks")
        return eviction.AdmissionPlan(admitted=plan.admitted, rejected=[key for key, _ in incoming if key in rejected]
                                      + plan.rejected, victims=victims + plan.victims,
                                      bytes_freed=freed + plan.bytes_freed)

    def record_owners(self, owners: Mapping[bytes, str]) -> None:
        """Stored namespace -> tenant, kept in LMDB: the namespace's chunks count in the tenant's share."""
        with self._writing():
            self.store.put_info({NAMESPACE_OWNER_PREFIX + namespace: tenant.encode()
                                 for namespace, tenant in owners.items()})
            with self._index_lock:
                for namespace, tenant in owners.items():
                    self._index.assign_owner(namespace, tenant)

    def share_usage(self, tenant: str) -> tuple[int, int] | None:
        """(bytes, max_bytes) of the tenant's share; None when it has no budget of its own."""
        with self._index_lock:
            share = self._index.shares.get(tenant)
            return None if share is None else (share.num_bytes, share.max_bytes)

    def delete_keys(self, keys: Sequence[ChunkKey], corrupted: bool = False) -> DeleteResult:
        """corrupted: a reader found these blobs failing their checksum; they count in Stats.corrupted."""
        with self._writing():
            removed = self._delete_locked(keys)
            self.events.publish(self._removal_events(EventKind.DELETED, removed))
            result = _deleted(removed)
            if corrupted and result.deleted:
                with self._lock:
                    self._counters.corrupted += result.deleted
        if corrupted and result.deleted:
            logger.error("%d chunks reported corrupt by a reader (%s): deleted", result.deleted,
                         ", ".join(key.hex()[:16] for key in keys))
        return result

    def delete_namespace(self, namespace: bytes) -> DeleteResult:
        with self._writing():
            keys = [self._index.key_of(slot) for slot in self._index.slots_in_namespace(namespace)]
            if not keys:
                raise NotFound(f"namespace {namespace.hex()[:16]} has no entries")
            removed = self._delete_locked(keys)
            self.events.publish([ChunkEvent(EventKind.CLEARED, namespace, unix_time=self._clock())])
            return _deleted(removed)

    def _delete_locked(self, keys: Sequence[ChunkKey]) -> list[tuple[ChunkKey, Entry]]:
        """Deletes the keys that are stored; returns them with their metadata. The caller holds _write_lock."""
        unique = list(dict.fromkeys(keys))
        targets = [(key, entry) for key, entry in zip(unique, self.store.get_entries(unique)) if entry is not None]
        self._commit(deletes=targets)
        return targets

    def _removal_events(self, kind: EventKind, removed: Sequence[tuple[ChunkKey, Entry]]) -> list[ChunkEvent]:
        now = self._clock()
        return [ChunkEvent(kind, entry.namespace, key, entry.content_key, entry.num_tokens, unix_time=now)
                for key, entry in removed]

    def held_chunks(self, after: bytes, limit: int) -> list[HeldChunk]:
        """Up to `limit` stored chunks whose keys sort after `after` (b"": from the first), in key order, read
        in one short read transaction: a snapshot of the cache is paged with many, never holding one open."""
        return self.store.held_page(after, limit)

    def set_pinned(self, keys: Sequence[ChunkKey], pinned: bool) -> PinResult:
        """Raises NotFound when none of the keys is stored."""
        with self._writing():
            stored = dict(zip(keys, self.store.get_entries(keys)))
            missing = [key for key in keys if stored[key] is None]
            updates = {key: dataclasses.replace(entry, pinned=pinned) for key, entry in stored.items()
                       if entry is not None}
            if not updates:
                raise NotFound(f"none of the {len(keys)} keys is stored")
            self._commit(updates=list(updates.items()))
        return PinResult(updated=len(updates), missing=missing)

    def flush_hits(self) -> int:
        """Applies the hits recorded since the last flush to the frequencies, in one transaction."""
        with self._writing():
            with self._lock:
                pending, self._pending_hits = self._pending_hits, Counter()
            now = self._clock()
            try:
                # A key evicted after its lookup has no entry left to update.
                updates = [(key, eviction.record_hits(entry, pending[key], now, self.half_life))
                           for key, entry in zip(pending, self.store.get_entries(list(pending))) if entry is not None]
                self._commit(updates=updates)
            except Exception:
                with self._lock:
                    self._pending_hits.update(pending)  # kept for the next flush
                raise
        return len(updates)

    def _commit(self, puts: Sequence[Put] = (), updates: Sequence[tuple[ChunkKey, Entry]] = (),
                deletes: Sequence[tuple[ChunkKey, Entry]] = (), continuations: Sequence[Continuation] = (),
                unindexed: Sequence[ChunkKey] = ()) -> None:
        """Writes one transaction, then mirrors it in the index. The caller holds _write_lock."""
        if not (puts or updates or deletes or continuations or unindexed):
            return
        self.store.write(puts=puts, updates=updates, deletes=deletes, continuations=continuations,
                         unindexed=unindexed)
        if deletes:
            with self._lock:
                for key, _ in deletes:
                    self._pending_hits.pop(key, None)
        with self._index_lock:
            for _, entry in deletes:
                self._index.remove(entry.slot)
            for key, entry, _ in puts:
                self._index.add(key, entry)
            for _, entry in updates:
                self._index.replace(entry)

    def stats(self) -> CacheStats:
        """While the index loads (after a restart), entries and bytes count what is loaded so far."""
        map_size = self.store.map_size
        with self._index_lock:
            num_entries, num_bytes, usage = len(self._index), self._index.num_bytes, self._index.usage()
        with self._lock:
            return CacheStats(num_entries=num_entries, num_bytes=num_bytes, max_bytes=self.max_bytes,
                              map_size=map_size, num_unflushed_hits=sum(self._pending_hits.values()),
                              counters=dataclasses.replace(self._counters), namespaces=usage)

    def close(self) -> None:
        """Flushes frequencies, syncs and closes the store."""
        self.flush_hits()
        self.store.sync()
        self.store.close()


class _Corrupted:
    """Marker returned from inside the read txn when the blob fails its check."""


_CORRUPTED = _Corrupted()


def _sized(view: memoryview, entry: Entry, copy_out: Callable[[memoryview], T]) -> T | _Corrupted:
    return _CORRUPTED if len(view) != entry.size_bytes else copy_out(view)


def _verified(view: memoryview, entry: Entry, copy_out: Callable[[memoryview], T]) -> T | _Corrupted:
    if len(view) != entry.size_bytes or crc32(view) != entry.checksum:
        return _CORRUPTED
    return copy_out(view)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading values a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _deleted(removed: Sequence[tuple[ChunkKey, Entry]]) -> DeleteResult:
    return DeleteResult(deleted=len(removed), bytes_freed=sum(entry.size_bytes for _, entry in removed))


def _first_of_each_key(chunks) -> list[IncomingChunk]:
    seen: dict[ChunkKey, IncomingChunk] = {}
    for chunk in chunks:
        seen.setdefault(chunk.key, chunk)
    return list(seen.values())
