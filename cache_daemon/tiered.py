"""Two tiers: this host's LMDB (L1) in front of a shared Redis (L2), read-through with promotion."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from cache_daemon.cache import CacheStats, ChunkCache, DeleteResult, LookupResult, PinResult, PutResult
from cache_daemon.deletes import DeleteLog
from cache_daemon.entry import ChunkKey, Entry, IncomingChunk
from cache_daemon.store import HeldChunk
from cache_daemon.errors import L2NotAcknowledged, NotFound
from cache_daemon.events import EventJournal
from cache_daemon.l2.promoter import L2Promoter
from cache_daemon.l2.redis_tier import L2Unavailable, RedisTier
from cache_daemon.l2.writer import WriteBehindQueue

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PROMOTE_BATCH = 64  # L2 hits held in memory at once while they are copied into LMDB


@dataclass(slots=True, frozen=True)
class L2Stats:
    url: str
    degraded: bool
    hits: int
    misses: int
    writes: int
    dropped_writes: int
    corrupted: int
    errors: int
    queued_writes: int
    forged: int
    promotion_batches: int
    calls_in_flight: int
    promoted: int  # chunks copied from L2 into LMDB after a Lookup reported them
    promoted_bytes: int
    not_arrived: int  # reported by a Lookup, then missing, failing their MAC, or past the promotion's deadline
    arrival_waits: int  # Fetch reads that waited for a chunk still arriving
    arriving: int  # chunks arriving now
    seconds: float  # time spent on L2: Lookups' value-free checks and promotions


class TieredCache:
    """The ChunkCache interface over two tiers. Lookup asks L2 only for what LMDB misses, and only
    whether it holds them (no values move while the caller waits); the values follow into LMDB in the
    background, and Fetch waits for a chunk still arriving. Store commits to LMDB first; L2 gets the
    chunks behind (bounded queue) or, with sync_writes, before Store replies. Pins, budget and eviction stay LMDB's; L2 evicts by its
    own maxmemory policy. An unreachable L2 turns into LMDB-only service, never a failed call.
    KV events report LMDB alone: Redis evicts by itself without telling any daemon, so what L2
    holds cannot be followed as events."""

    def __init__(self, l1: ChunkCache, l2: RedisTier, sync_writes: bool = False,
                 queue_bytes: int = 256 << 20, sync_deadline_s: float = 10.0,
                 promote_batch: int = DEFAULT_PROMOTE_BATCH) -> None:
        self.l1 = l1
        self.l2 = l2
        self.sync_writes = sync_writes
        self._sync_deadline_s = sync_deadline_s
        self._writer = WriteBehindQueue(self._write_behind, queue_bytes)
        self._lock = threading.Lock()
        # Keys this daemon is writing to L2 and has not checked again since (_put_in_l2): a Lookup takes none of them
        # from L2, so no promotion copies back into LMDB what a Delete removed before the write reached Redis.
        self._writing_to_l2: Counter[bytes] = Counter()
        self._num_hits = 0
        self._num_misses = 0
        self._num_sync_writes = 0
        self._clock = time.monotonic
        self.promoter = L2Promoter(l1, l2, promote_batch)

    @property
    def store(self):
        return self.l1.store

    @property
    def max_bytes(self) -> int:
        return self.l1.max_bytes

    @property
    def deletes(self) -> DeleteLog:
        return self.l1.deletes

    @property
    def events(self) -> EventJournal:
        return self.l1.events

    def lookup(self, namespace: bytes, prefix_keys: Sequence[bytes], content_keys: Sequence[bytes],
               partial_keys: Sequence[bytes] = ()) -> LookupResult:
        result = self.lookup_in_l1(namespace, prefix_keys, content_keys, partial_keys)
        if result is None:
            result = self.lookup_with_l2(namespace, prefix_keys, content_keys, partial_keys)
        return result

    def lookup_in_l1(self, namespace: bytes, prefix_keys: Sequence[bytes], content_keys: Sequence[bytes],
                     partial_keys: Sequence[bytes] = ()) -> LookupResult | None:
        """The answer when LMDB alone holds everything L2 could add (counted as a lookup), else None:
        no network, so the servicer runs it on the event loop and only the rest waits on Redis."""
        result = self.l1.probe(namespace, prefix_keys, content_keys, partial_keys)
        missing, content_wanted = _wanted_from_l2(result, prefix_keys, content_keys, partial_keys)
        if missing or content_wanted:
            return None
        self.l1.record_lookup(result, prefix_keys, partial_keys)
        return result

    def lookup_with_l2(self, namespace: bytes, prefix_keys: Sequence[bytes], content_keys: Sequence[bytes],
                       partial_keys: Sequence[bytes] = ()) -> LookupResult:
        """LMDB's index, then one value-free round trip to L2 (STRLEN of what LMDB misses, the content sets):
        the L2 keys are answered as hits *arriving*, and their promotion into LMDB starts in the background.
        Fetch of an arriving key waits for it (ArrivingKeys); one that never arrives (gone, failing its
        MAC, past its deadline) is a miss there, which ends the reader's run. Content keys are answered
        from LMDB alone: a content set's members are unverified until their records are read, so L2's
        candidates are promoted (checked against their signed headers) for the next Lookup to find."""
        result = self.l1.probe(namespace, prefix_keys, content_keys, partial_keys)
        self.l1.record_lookup(result, prefix_keys, partial_keys)
        missing, content_wanted = _wanted_from_l2(result, prefix_keys, content_keys, partial_keys)
        if not missing and not content_wanted:
            return result
        already = self.promoter.arriving.arriving(missing)
        asked = [key for key in missing if key not in already]
        started = self._clock()
        try:
            sizes, candidates = self.l2.sizes_with_content(asked, content_wanted)
        except L2Unavailable:  # logged once per outage by the tier: LMDB's answer stands
            sizes, candidates = [0] * len(asked), []
        with self._lock:  # read after the round trip: a write that reached Redis before it is in this set until checked
            writing = {key for key in (*asked, *(key for found in candidates for key in found))
                       if key in self._writing_to_l2}
        in_l2 = {key: size for key, size in zip(asked, sizes) if size > 0 and key not in writing}
        if writing:
            candidates = [[key for key in found if key not in writing] for found in candidates]
        self.promoter.add_seconds(self._clock() - started)
        with self._lock:
            self._num_hits += len(in_l2)
            self._num_misses += len(asked) - len(in_l2) + len(content_wanted)
        result, wanted = _with_arriving(result, prefix_keys, partial_keys, already | set(in_l2))
        sized = [(key, in_l2[key]) for key in wanted if key in in_l2]
        if sized or any(candidates):
            self.promoter.start(namespace, sized, content_wanted, candidates)
        return result

    def wait_for_promotions(self, timeout_s: float | None = None) -> bool:
        """Until every promotion started so far has ended (tests, benchmarks); False on timeout."""
        return self.promoter.wait_idle(timeout_s)

    def put_many(self, chunks: Sequence[IncomingChunk]) -> PutResult:
        """Raises L2NotAcknowledged (sync writes) when L2 did not take them; LMDB holds them anyway."""
        result = self.l1.put_many(chunks)
        if not self.sync_writes:
            self._writer.submit(chunks)
            return result
        try:
            num_written = self._put_in_l2(chunks, wait=True, deadline_s=self._sync_deadline_s)
        except L2Unavailable as error:
            raise L2NotAcknowledged(f"stored in this host's LMDB, not acknowledged by L2: {error}") from error
        with self._lock:
            self._num_sync_writes += num_written
        return result

    def _write_behind(self, chunks: Sequence[IncomingChunk]) -> None:
        self._put_in_l2(chunks)

    def _put_in_l2(self, chunks: Sequence[IncomingChunk], **put_options) -> int:
        """Writes to L2 the chunks no Delete their writer had not seen names, then (whether the write succeeded or
        not: it may have reached Redis) checks again and removes those one names now: a Delete begun before that
        check is caught by it, one begun after it removes from L2 after this write. Until then Lookups take none of
        these keys from L2, and a removal here voids the promotions in flight, as a Delete does. So a write-back
        does not put back into L2, nor through L2 into LMDB, what a Delete removed (LMDB checked it on its own).
        Returns how many chunks it wrote."""
        wanted = self.deletes.not_superseded(chunks)
        keys = [chunk.key for chunk in wanted]
        with self._lock:
            self._writing_to_l2.update(keys)
        try:
            self.l2.put(wanted, **put_options)
        finally:
            try:
                kept = {id(chunk) for chunk in self.deletes.not_superseded(wanted)}
                late = list(dict.fromkeys(chunk.key for chunk in wanted if id(chunk) not in kept))
                if late:
                    self._maybe_on_l2(lambda: self.l2.delete(late), 0)
                    self.promoter.void_in_flight()
            finally:
                with self._lock:
                    self._writing_to_l2.subtract(keys)
                    self._writing_to_l2 = +self._writing_to_l2  # drops the keys at zero
        return len(wanted)

    def drain_writes(self, timeout_s: float | None = None) -> bool:
        return self._writer.drain(timeout_s)

    # A Delete removes from L2 first, then voids the promotions in flight, then removes from LMDB: a promotion that
    # read a deleted key from L2 before it cannot store it after the LMDB delete, and no Lookup after the Delete
    # answers it as arriving (the inference service's L0 trusts a Lookup's answer at its delete count).
    def delete_keys(self, keys: Sequence[ChunkKey], corrupted: bool = False) -> DeleteResult:
        num_deleted_l2 = self._maybe_on_l2(lambda: self.l2.delete(list(dict.fromkeys(keys))), 0)
        self.promoter.void_in_flight()
        result = self.l1.delete_keys(keys, corrupted)
        return DeleteResult(deleted=max(result.deleted, num_deleted_l2), bytes_freed=result.bytes_freed)

    def delete_namespace(self, namespace: bytes) -> DeleteResult:
        num_deleted_l2 = self._maybe_on_l2(lambda: self.l2.delete_namespace(namespace), 0)
        self.promoter.void_in_flight()
        try:
            result = self.l1.delete_namespace(namespace)
        except NotFound:
            result = None
        if result is None and not num_deleted_l2:
            raise NotFound(f"namespace {namespace.hex()[:16]} has no entries in either tier")
        if result is None:
            return DeleteResult(deleted=num_deleted_l2, bytes_freed=0)
        return DeleteResult(deleted=max(result.deleted, num_deleted_l2), bytes_freed=result.bytes_freed)

    def _maybe_on_l2(self, operation: Callable[[], T], default: T) -> T:
        try:
            return operation()
        except L2Unavailable as error:
            logger.warning("L2 left as it was (%s): its copies go when Redis evicts them", error)
            return default

    def read(self, key: ChunkKey, copy_out: Callable[[memoryview], T], verify: bool = True) -> tuple[Entry, T] | None:
        """LMDB's chunk; a key a Lookup answered from L2 is waited for until its promotion ends."""
        found = self.l1.read(key, copy_out, verify)
        if found is None:
            # Read again whether or not it waited: its promotion may have stored it and let it go between the
            # first read and the wait (then wait_for finds it no longer arriving).
            self.promoter.wait_for(key)
            found = self.l1.read(key, copy_out, verify)
        return found

    def entry(self, key: ChunkKey) -> Entry | None:
        return self.l1.entry(key)

    def held_chunks(self, after: bytes, limit: int) -> list[HeldChunk]:
        return self.l1.held_chunks(after, limit)

    def set_pinned(self, keys: Sequence[ChunkKey], pinned: bool) -> PinResult:
        return self.l1.set_pinned(keys, pinned)

    def record_owners(self, owners) -> None:
        self.l1.record_owners(owners)

    def share_usage(self, tenant: str) -> tuple[int, int] | None:
        return self.l1.share_usage(tenant)

    def flush_hits(self) -> int:
        return self.l1.flush_hits()

    def wait_until_loaded(self, timeout_s: float | None = None) -> bool:
        return self.l1.wait_until_loaded(timeout_s)

    def stats(self) -> CacheStats:
        return self.l1.stats()

    def l2_stats(self) -> L2Stats:
        with self._lock:
            hits, misses, sync_writes = self._num_hits, self._num_misses, self._num_sync_writes
        promoted = self.promoter.snapshot()
        return L2Stats(url=self.l2.address.redacted(), degraded=self.l2.degraded, hits=hits, misses=misses,
                       writes=self._writer.num_written + sync_writes, dropped_writes=self._writer.num_dropped,
                       corrupted=self.l2.num_corrupted, errors=self.l2.num_errors,
                       queued_writes=self._writer.num_queued, forged=self.l2.num_forged,
                       promotion_batches=promoted.batches, calls_in_flight=self.l2.num_in_flight,
                       promoted=promoted.promoted, promoted_bytes=promoted.promoted_bytes,
                       not_arrived=promoted.not_arrived, arrival_waits=promoted.arrival_waits,
                       arriving=len(self.promoter.arriving), seconds=promoted.seconds)

    def close(self) -> None:
        """Stops promotions between batches (what they stored stays), gives queued L2 writes a few
        seconds, then closes both tiers."""
        self.promoter.close()
        self._writer.close()
        self.l1.close()
        self.l2.close()


def _wanted_from_l2(result: LookupResult, prefix_keys: Sequence[bytes], content_keys: Sequence[bytes],
                    partial_keys: Sequence[bytes]) -> tuple[list[ChunkKey], list[bytes]]:
    """The keys LMDB missed, and the content keys of chunks found neither by prefix nor by content."""
    missing = [ChunkKey(key) for key, hit in zip(prefix_keys, result.prefix_hit) if not hit]
    if partial_keys and result.partial_index is None:
        missing += [ChunkKey(key) for key in partial_keys]
    content_found = {index for index, _ in result.content_hits}
    content_wanted = [key for index, key in enumerate(content_keys)
                      if key and not result.prefix_hit[index] and index not in content_found]
    return missing, content_wanted


def _with_arriving(result: LookupResult, prefix_keys: Sequence[bytes], partial_keys: Sequence[bytes],
                   in_l2: set[ChunkKey]) -> tuple[LookupResult, list[ChunkKey]]:
    """LMDB's answer with the keys L2 holds counted as hits, and those keys in the order they should
    arrive: the prefix keys in prompt order (the run's head first), then the partial chunk answered."""
    prefix_hit = [hit or key in in_l2 for key, hit in zip(prefix_keys, result.prefix_hit)]
    wanted = [ChunkKey(key) for key, hit in zip(prefix_keys, result.prefix_hit) if not hit and key in in_l2]
    partial_index = result.partial_index
    if partial_index is None:
        partial_index = next((index for index, key in enumerate(partial_keys) if key in in_l2), None)
        if partial_index is not None:
            wanted.append(ChunkKey(partial_keys[partial_index]))
    prefix_run = prefix_hit.index(False) if False in prefix_hit else len(prefix_hit)
    return LookupResult(prefix_hit=prefix_hit, prefix_run=prefix_run, content_hits=result.content_hits,
                        partial_index=partial_index), wanted
