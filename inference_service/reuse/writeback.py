"""Encodes new full chunks and stores them on one background thread, off the request's critical path."""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from inference_service.store.protocol import (DEFAULT_MAX_STREAM_BYTES, ChunkStore, DeleteEpoch, StoreItem,
                                             StoreUnavailable)
from kvboost_keys.chunking import Chunk
from inference_service.kv.blobs import DEFAULT_GROUP_SIZE, encode_chunk_kv
from inference_service.kv.rope import RopeParams
from inference_service.kv_memory.host_tier import HostTier
from inference_service.kv_memory.l0_tier import L0Tier
from inference_service.reuse.settled_writes import SettledLog, SettledWrite
from inference_service.kv_memory.kv_buffers import LayerKV, stack_layers
from inference_service.model.threads import confine_to_this_thread, lower_this_threads_priority

logger = logging.getLogger(__name__)


def _background_thread() -> None:
    """The Store thread: no OpenMP team of its own, and below the step loop's priority (on two cores a write-back's
    encoding otherwise takes CPU time from the next request's prefill)."""
    confine_to_this_thread()
    lower_this_threads_priority()


@dataclass(slots=True, frozen=True)
class PendingChunks:
    """Chunks whose K/V one prefill computed, waiting to be stored."""

    namespace: bytes
    chunks: tuple[Chunk, ...]
    prefix_keys: tuple[bytes, ...]
    content_keys: tuple[bytes | None, ...]
    new_kv: LayerKV  # per layer [1, kv_heads, n, head_dim] for the prefill's tokens
    kv_start: int  # prompt position of new_kv's first token
    pin: bool = False
    request_id: str = ""
    # K/V buffers [layers, kv_heads, capacity, head_dim] whose positions [0, kv_start) hold the tokens before
    # the prefill (fetched): a chunk that starts before kv_start (after a partial hit) takes them from here.
    head_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    # The prefix key each chunk chains from (reuse inside a chunk indexes chunks under it); () : not indexed.
    parent_keys: tuple[bytes, ...] = ()
    # The delete epoch of the Lookup the K/V were computed after (AssembledContext.delete_epoch; None: none): the
    # store leaves out a chunk a later Delete named, and L0 counts the chunks as confirmed at it only.
    delete_epoch: DeleteEpoch | None = None

    def __post_init__(self) -> None:
        assert len(self.chunks) == len(self.prefix_keys) == len(self.content_keys), "one key of each kind per chunk"
        assert not self.parent_keys or len(self.parent_keys) == len(self.chunks), "one parent key per chunk"
        assert self.head_kv is not None or all(chunk.start >= self.kv_start for chunk in self.chunks), (
            "every chunk lies in the prefill's tokens, or the head K/V holds its start")

    def without(self, stored: set[bytes]) -> PendingChunks | None:
        """These chunks minus those whose prefix key is in `stored` (None when none is left); adds the rest to it."""
        keep = [index for index, key in enumerate(self.prefix_keys) if key not in stored]
        stored.update(self.prefix_keys)
        if not keep:
            return None
        if len(keep) == len(self.chunks):
            return self
        return dataclasses.replace(self, chunks=tuple(self.chunks[i] for i in keep),
                                   prefix_keys=tuple(self.prefix_keys[i] for i in keep),
                                   content_keys=tuple(self.content_keys[i] for i in keep),
                                   parent_keys=tuple(self.parent_keys[i] for i in keep) if self.parent_keys else ())

    def chunk_kv(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [layers, kv_heads, chunk length, head_dim] of one of the chunks."""
        if chunk.start >= self.kv_start:
            return stack_layers(self.new_kv, chunk.start - self.kv_start, chunk.end - self.kv_start)
        keys, values = stack_layers(self.new_kv, 0, chunk.end - self.kv_start)
        head_keys, head_values = self.head_kv
        return (torch.cat([head_keys[:, :, chunk.start : self.kv_start], keys], dim=2),
                torch.cat([head_values[:, :, chunk.start : self.kv_start], values], dim=2))


def encode_pending(pending: PendingChunks, bits: int, group_size: int = DEFAULT_GROUP_SIZE,
                   rope: RopeParams | None = None) -> list[StoreItem]:
    """Store items for the pending chunks, encoded by kv.blobs.encode_chunk_kv (rope: see there)."""
    return list(iter_encoded(pending, bits, group_size, rope))


def iter_encoded(pending: PendingChunks, bits: int, group_size: int = DEFAULT_GROUP_SIZE,
                 rope: RopeParams | None = None) -> Iterator[StoreItem]:
    """The pending chunks' store items one at a time, each encoded when it is asked for."""
    parents = pending.parent_keys or (b"",) * len(pending.chunks)
    for chunk, key, content, parent in zip(pending.chunks, pending.prefix_keys, pending.content_keys, parents):
        keys, values = pending.chunk_kv(chunk)
        blob = encode_chunk_kv(keys, values, chunk.start, bits, group_size, rope)
        yield StoreItem(key, pending.namespace, content, len(chunk.token_ids), blob, pending.pin,
                        parent, tuple(chunk.token_ids) if parent else (), pending.delete_epoch)


def bounded_batches(items: Iterable[StoreItem], max_bytes: int) -> Iterator[list[StoreItem]]:
    """Consecutive items in batches of at most max_bytes of blobs (an item larger than that goes alone)."""
    batch: list[StoreItem] = []
    num_bytes = 0
    for item in items:
        if batch and num_bytes + len(item.blob) > max_bytes:
            yield batch
            batch, num_bytes = [], 0
        batch.append(item)
        num_bytes += len(item.blob)
    if batch:
        yield batch


class WriteBack:
    """One worker thread, so stores happen in submission order and never compete with each other."""

    def __init__(self, cache: ChunkStore, bits: int, on_stored: Callable[[int, int], None],
                 group_size: int = DEFAULT_GROUP_SIZE, rope: RopeParams | None = None,
                 max_stream_bytes: int = DEFAULT_MAX_STREAM_BYTES, l0: L0Tier | None = None,
                 host: HostTier | None = None) -> None:
        """max_stream_bytes: blob bytes per store call; a larger write-back goes out as several, encoded as it
        goes (its encoded bytes are never all in memory at once). l0: L0, which keeps every chunk written back
        (before the store has it) and the whole chunks requests fetched. host: the host tier, which takes what L0
        evicts, and what L0 does not keep (or every whole chunk, with no L0). Both come wired to each other from
        kv_memory/memory_plan.build_tiers, which hands the same two to the engine's parts."""
        assert max_stream_bytes > 0, f"max_stream_bytes must be positive, got {max_stream_bytes}"
        self.l0 = l0
        self.host = host
        self._cache = cache
        self._max_stream_bytes = max_stream_bytes
        self._bits = bits
        self._group_size = group_size
        self._rope = rope  # un-rotates keys before quantizing (see encode_pending); None: keys as computed
        self._on_stored = on_stored  # (chunks stored, bytes stored)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvboost-writeback",
                                            initializer=_background_thread)
        self._l0_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvboost-l0",
                                                initializer=confine_to_this_thread)
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self._in_flight: Counter[bytes] = Counter()  # prefix keys queued or being stored
        self.on_settled: Callable[[], None] | None = None  # told after each write-back ends (stored or failed)
        self.settled = SettledLog()  # what each ended write-back may have stored: an answer asked before may be stale

    def storing(self, keys) -> bool:
        """Whether any of these prefix keys is queued or being stored now and not in L0 (a request that needs it
        had better wait for it than recompute it; one L0 holds is placed from there at once)."""
        with self._lock:
            return any(key in self._in_flight and (self.l0 is None or not self.l0.is_pending(key)) for key in keys)

    def submit(self, pending: PendingChunks, on_done: Callable[[int, BaseException | None], None] | None = None) -> None:
        """Queues the chunks; returns at once. on_done(stored count, error) runs on the write-back thread once they
        are stored or have failed (the K/V they read may be reused from then on)."""
        if not pending.chunks:
            if on_done is not None:
                on_done(0, None)
            return
        with self._lock:
            self._in_flight.update(pending.prefix_keys)
        future = self._executor.submit(self._store_in_background, pending, on_done)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

    def store_now(self, pending: PendingChunks) -> int:
        """Encodes and stores on the calling thread, in store calls of at most max_stream_bytes each; returns the
        stored count.

        Raises:
            StoreUnavailable: the cache cannot be reached, or a store call failed (what the calls before it stored
                stays stored and counted).
        """
        total = 0
        with torch.inference_mode():
            self._keep_in_tiers(pending)
            try:
                items = iter_encoded(pending, self._bits, self._group_size, self._rope)
                for batch in bounded_batches(items, self._max_stream_bytes):
                    stored = self._cache.store(batch)
                    self._on_stored(stored, sum(len(item.blob) for item in batch))
                    total += stored
            finally:
                if self.l0 is not None:
                    self.l0.settle(pending.prefix_keys)
        return total

    def _keep_in_tiers(self, pending: PendingChunks) -> None:
        """L0 keeps the chunks' K/V as computed (whole chunks and a prompt's tail), before the daemon has them: a
        request that repeats the prompt meanwhile is placed from L0 instead of waiting for the Store (the 16-bit
        blobs hold exactly these values). L0 never costs a daemon write: its failure is logged, the write goes on."""
        if self.l0 is None and self.host is None:
            return
        try:
            parents = pending.parent_keys or (None,) * len(pending.chunks)  # L0 evicts a chunk after its successors
            for chunk, key, parent in zip(pending.chunks, pending.prefix_keys, parents):
                self._keep(key, *pending.chunk_kv(chunk), parent if chunk.start else None, pending=True,
                           epoch=pending.delete_epoch)
        except Exception:
            logger.exception("[%s] keeping chunks in L0 failed", pending.request_id)

    def _keep(self, key: bytes, keys: torch.Tensor, values: torch.Tensor, parent: bytes | None,
              pending: bool = False, epoch: DeleteEpoch | None = None) -> None:
        """L0 keeps the chunk; the host tier takes it when L0 does not (off, or no room it may make). Its bytes were
        computed here, or checked when they were fetched: no checksum again."""
        if self.l0 is not None and self.l0.add(key, keys, values, pending=pending, parent=parent, epoch=epoch):
            return
        if self.host is not None:
            self.host.add(key, keys, values, parent)

    def submit_fetched(self, buffers: tuple[torch.Tensor, torch.Tensor],
                       spans: list[tuple[bytes, int, int, bytes | None]], on_done: Callable[[], None]) -> None:
        """Queues copies of chunks placed from the store (key, start, end in `buffers`, keys and values
        [layers, kv_heads, capacity, head_dim], and the prefix key each chains from) into L0; on_done runs on the
        write-back thread once they are copied (the buffers may be reused from then on)."""
        def copy() -> None:
            try:
                with torch.inference_mode():
                    for key, start, end, parent in spans:
                        self._keep(key, buffers[0][:, :, start:end], buffers[1][:, :, start:end], parent)
            except Exception:  # a background thread has no caller to raise to; L0 only misses these chunks
                logger.exception("keeping %d fetched chunks in L0 failed", len(spans))
            finally:
                on_done()

        future = self._l0_executor.submit(copy)  # its own thread: never queued behind a large Store
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

    def _store_in_background(self, pending: PendingChunks, on_done) -> None:
        stored, failure = 0, None
        try:
            stored = self.store_now(pending)
        except StoreUnavailable as error:
            failure = error
            logger.warning("[%s] write-back of %d chunks skipped: %s", pending.request_id, len(pending.chunks), error)
        except Exception as error:  # a background thread has no caller to raise to
            failure = error
            logger.exception("[%s] write-back of %d chunks failed", pending.request_id, len(pending.chunks))
        # Logged before its keys leave the in-flight set: a request held for them then finds this write-back.
        self.settled.add(SettledWrite.of(pending.prefix_keys, pending.content_keys, pending.parent_keys,
                                         [chunk.token_ids for chunk in pending.chunks]))
        with self._lock:
            self._in_flight.subtract(pending.prefix_keys)
            self._in_flight = +self._in_flight  # drops the keys at zero
        if on_done is not None:
            on_done(stored, failure)
        if self.on_settled is not None:
            self.on_settled()

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    @property
    def num_in_flight(self) -> int:
        """Write-backs (and copies of fetched chunks into L0) queued or running now."""
        with self._lock:
            return len(self._pending)

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every write-back queued so far has finished (or timeout seconds)."""
        with self._lock:
            pending = list(self._pending)
        wait(pending, timeout=timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._l0_executor.shutdown(wait=True)
