"""L2 values into LMDB after the Lookup that reported them, on the promoter's own threads."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

from cache_daemon.cache import ChunkCache
from cache_daemon.entry import ChunkKey, IncomingChunk
from cache_daemon.errors import BudgetExceeded
from cache_daemon.events import EventKind
from cache_daemon.l2.promotion import ArrivingKeys, promotion_deadline_s, sized_batches
from cache_daemon.l2.redis_tier import L2Hit, L2Unavailable, RedisTier

logger = logging.getLogger(__name__)

MAX_CONTENT_CANDIDATES = 4  # contexts tried per content key in L2
PROMOTION_THREADS = 2  # promotions run beside each other; LMDB serializes their writes anyway


@dataclass(slots=True)
class PromotionCounters:
    batches: int = 0  # batches of L2 records copied into LMDB
    promoted: int = 0  # chunks stored into LMDB by promotions
    promoted_bytes: int = 0
    not_arrived: int = 0  # claimed keys that never reached LMDB: gone, failing their MAC, past the deadline
    arrival_waits: int = 0  # reads that waited for an arriving key
    seconds: float = 0.0  # time on L2: Lookups' value-free checks and promotions


@dataclass(slots=True)
class _Promoted:
    """What one promotion found in L2 and stored into LMDB so far."""

    num_stored: int = 0
    num_bytes: int = 0
    keys: set[ChunkKey] = field(default_factory=set)


class L2Promoter:
    """Copies the keys a Lookup reported from L2 into LMDB: claimed first (so a reader waits for them from
    then on, until the promotion's byte-sized deadline), then read from L2 in prompt order, in batches
    bounded by chunks and bytes, each verified (CRC-32, MAC) before it is stored. Every claimed key is
    released when its batch ends, stored or not. The chunks go in as the namespace's owner stores them
    (charged to that tenant's share)."""

    def __init__(self, l1: ChunkCache, l2: RedisTier, promote_batch: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert promote_batch >= 1, f"promote_batch must be >= 1, got {promote_batch}"
        self.l1 = l1
        self.l2 = l2
        self.promote_batch = promote_batch
        self.arriving = ArrivingKeys(clock)
        self.counters = PromotionCounters()
        self._clock = clock
        self._lock = threading.Lock()
        self._closing = False
        # Deletes void what promotions read from L2 before them (void_in_flight): a batch is stored only under
        # this lock, and only if no Delete has moved the generation since the batch was read.
        self._put_guard = threading.Lock()
        self._generation = 0
        self._pool = ThreadPoolExecutor(PROMOTION_THREADS, thread_name_prefix="l2-promote")
        self._jobs: set[Future] = set()

    def start(self, namespace: bytes, sized: list[tuple[ChunkKey, int]], content_keys: list[bytes],
              candidates: list[list[ChunkKey]]) -> None:
        """Claims the keys (each with its record's length) and promotes them, then the content keys'
        candidates, in the background."""
        deadline = self._clock() + promotion_deadline_s(sum(size for _, size in sized))
        claimed = set(self.arriving.claim((key for key, _ in sized), deadline))
        sized = [(key, size) for key, size in sized if key in claimed]
        try:
            job = self._pool.submit(self._promote_all, namespace, sized, content_keys, candidates, deadline)
        except RuntimeError:  # shutting down: nothing will arrive
            self.arriving.release(claimed)
            return
        with self._lock:
            self._jobs.add(job)
        job.add_done_callback(self._job_done)

    def wait_for(self, key: ChunkKey) -> bool:
        """Waits while the key is arriving; False when it was not."""
        waited = self.arriving.wait(key)
        if waited:
            with self._lock:
                self.counters.arrival_waits += 1
        return waited

    def add_seconds(self, seconds: float) -> None:
        with self._lock:
            self.counters.seconds += seconds

    def snapshot(self) -> PromotionCounters:
        with self._lock:
            counters = self.counters
            return PromotionCounters(counters.batches, counters.promoted, counters.promoted_bytes,
                                     counters.not_arrived, counters.arrival_waits, counters.seconds)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Until every promotion started so far has ended; False on timeout."""
        with self._lock:
            jobs = list(self._jobs)
        return not wait(jobs, timeout_s).not_done

    def close(self) -> None:
        """Stops promotions between batches (what they stored stays) and releases every waiting reader."""
        self._closing = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.arriving.release(self.arriving.snapshot())

    def void_in_flight(self) -> None:
        """For a Delete, after it removed its keys from L2 and before it removes them from LMDB: what promotions
        read from L2 before now is not stored (it may be what the Delete removes: stored after the LMDB delete, it
        would come back), and no key is answered as arriving any more (a Lookup after the Delete would report a
        deleted chunk as a hit). Batches read from now on see L2 without the deleted keys and are stored as usual;
        the keys this voids are misses until a Lookup finds them in L2 again."""
        with self._put_guard:
            self._generation += 1
        self.arriving.release(self.arriving.snapshot())

    def _job_done(self, job: Future) -> None:
        with self._lock:
            self._jobs.discard(job)

    def _promote_all(self, namespace: bytes, sized: list[tuple[ChunkKey, int]], content_keys: list[bytes],
                     candidates: list[list[ChunkKey]], deadline: float) -> None:
        promoted = _Promoted()
        started = self._clock()
        remaining = [key for key, _ in sized]
        try:
            for batch in sized_batches(sized, self.promote_batch):
                if self._closing or self._clock() > deadline:
                    logger.warning("promotion of %d L2 chunks stopped (%s): they are misses", len(remaining),
                                   "closing" if self._closing else "past its deadline")
                    break
                try:
                    generation = self._generation  # before the read: a Delete after it voids what it read
                    self._promote(namespace, self.l2.get(batch), promoted, generation)
                finally:
                    self.arriving.release(batch)
                    remaining = remaining[len(batch):]
            if content_keys and not self._closing:
                self._promote_content(namespace, content_keys, candidates, promoted)
        except L2Unavailable:
            pass  # logged once per outage by the tier; what was promoted so far stays
        finally:
            self.arriving.release(remaining)
            with self._lock:
                self.counters.seconds += self._clock() - started
                self.counters.promoted += promoted.num_stored
                self.counters.promoted_bytes += promoted.num_bytes
                self.counters.not_arrived += sum(1 for key, _ in sized if key not in promoted.keys)

    def _promote(self, namespace: bytes, hits: Sequence[L2Hit | None], promoted: _Promoted, generation: int) -> None:
        """Stores the hits read from L2 at `generation` (void_in_flight), unless a Delete has run since."""
        found = [hit for hit in hits if hit is not None and hit.entry.namespace == namespace
                 and hit.key not in promoted.keys]
        if not found:
            return
        with self._put_guard:
            if generation != self._generation:
                logger.info("%d L2 chunks read before a Delete are not promoted: they are misses", len(found))
                return
            with self._lock:
                self.counters.batches += 1
            try:
                result = self.l1.put_many([_incoming(hit) for hit in found], EventKind.PROMOTED)
            except BudgetExceeded as error:
                logger.warning("L2 hits not promoted into LMDB: %s", error)
                return
        promoted.keys.update(hit.key for hit in found)
        promoted.num_stored += result.stored
        promoted.num_bytes += sum(len(hit.blob) for hit in found)

    def _promote_content(self, namespace: bytes, content_keys: list[bytes], candidates: list[list[ChunkKey]],
                         promoted: _Promoted) -> None:
        """For each content key, the first stored context in this namespace that really holds those
        tokens (its signed header says so: a planted set member is skipped), in batches."""
        per_batch = max(1, self.promote_batch // MAX_CONTENT_CANDIDATES)
        for start in range(0, len(content_keys), per_batch):
            group = list(zip(content_keys[start:start + per_batch], candidates[start:start + per_batch]))
            wanted = list(dict.fromkeys(key for _, keys in group for key in keys[:MAX_CONTENT_CANDIDATES]
                                        if key not in promoted.keys))
            if not wanted:
                continue
            generation = self._generation
            chunks = dict(zip(wanted, self.l2.get(wanted)))
            chosen = []
            for content_key, keys in group:
                usable = (chunks.get(key) for key in keys[:MAX_CONTENT_CANDIDATES])
                hit = next((hit for hit in usable if hit is not None and hit.entry.namespace == namespace
                            and hit.entry.content_key == content_key), None)
                if hit is not None and all(hit.key != other.key for other in chosen):
                    chosen.append(hit)
            self._promote(namespace, chosen, promoted, generation)


def _incoming(hit: L2Hit) -> IncomingChunk:
    entry = hit.entry
    return IncomingChunk(key=hit.key, namespace=entry.namespace, content_key=entry.content_key,
                         num_tokens=entry.num_tokens, checksum=entry.checksum, pinned=False, blob=hit.blob)
