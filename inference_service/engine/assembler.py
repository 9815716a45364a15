"""Looks a prompt's chunks up, fetches the hits and places their K/V into the request's K/V buffers."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator, TypeVar

import torch

from inference_service.store.protocol import StoreUnavailable, ChunkStore
from inference_service.kv.blobs import decode_hit, place_hit_
from inference_service.engine.prompts import PromptPlan
from inference_service.kv.rope import RopeParams
from inference_service.model.kv_buffers import KVGeometry, allocate_kv

logger = logging.getLogger(__name__)

_DONE = object()  # marks the end of a prefetched stream
T = TypeVar("T")


@dataclass(slots=True)
class AssembledContext:
    """Buffers whose first num_cached_tokens positions hold cached K/V, ready for build_cache."""

    key_buffer: torch.Tensor | None  # [layers, kv_heads, capacity, head_dim]; None when nothing was reused
    value_buffer: torch.Tensor | None
    num_cached_tokens: int = 0
    num_cached_chunks: int = 0  # leading chunks whose K/V are in the buffers
    num_recomputed_tokens: int = 0  # cached tokens whose K/V were recomputed by repair
    num_bytes_fetched: int = 0
    degraded: bool = False  # the cache became unreachable; chunks placed before that are still used
    content_hits: dict[int, bytes] = field(default_factory=dict)  # looked up, not reused yet


def empty_context(degraded: bool = False) -> AssembledContext:
    return AssembledContext(None, None, degraded=degraded)


def assemble_context(
    cache: ChunkStore,
    namespace: bytes,
    prompt: PromptPlan,
    geometry: KVGeometry,
    device: torch.device,
    dtype: torch.dtype,
    capacity: int,
    with_content_hits: bool,
    rope: RopeParams | None = None,
) -> AssembledContext:
    """Everything the cache can give for this prompt, in buffers with room for `capacity` tokens.

    Never raises for cache trouble: an unreachable cache gives an empty, degraded context; a bad or
    missing blob ends the reused run there. rope: rotates keys stored un-rotated into place (such blobs
    end the run when it is None).

    This is the one place hits become K/V: prefix hits now; content hits plug in here (repair).
    """
    content_keys = list(prompt.content_keys) if with_content_hits else None
    try:
        lookup = cache.lookup(namespace, list(prompt.prefix_keys), content_keys)
    except StoreUnavailable as error:
        logger.warning("cache unavailable, serving without it: %s", error)
        return empty_context(degraded=True)
    if lookup.prefix_run == 0:
        return AssembledContext(None, None, content_hits=lookup.content_hits)
    context = fetch_prefix_run(cache, prompt, lookup.prefix_run, allocate_kv(geometry, capacity, device, dtype), rope)
    context.content_hits = lookup.content_hits
    return context


def fetch_prefix_run(
    cache: ChunkStore, prompt: PromptPlan, run: int, buffers: tuple[torch.Tensor, torch.Tensor],
    rope: RopeParams | None = None,
) -> AssembledContext:
    """Fetches the first `run` chunks and copies each decoded blob into its slice of the buffers.

    buffers: keys, values [layers, kv_heads, capacity, head_dim]. A missing blob, one that fails to
    decode, one that does not fit its chunk, or one whose keys cannot be rotated into place ends the
    run there.
    """
    chunks = prompt.chunks.chunks[:run]
    keys, values = buffers
    shape = (keys.shape[0], keys.shape[1], chunks[-1].end, keys.shape[3])
    verify = not getattr(cache, "verifies_blobs", False)  # one checksum per blob is enough
    num_placed = num_bytes = 0
    degraded = False
    blobs = None
    try:
        blobs = prefetched(cache.fetch(list(prompt.prefix_keys[:run])))
        for chunk, expected_key, (key, blob) in zip(chunks, prompt.prefix_keys, blobs):
            decoded = decode_hit(expected_key, key, blob, chunk.start, len(chunk.token_ids), shape, verify, rope=rope,
                                 device=keys.device)
            span = slice(chunk.start, chunk.end)
            if decoded is None or not place_hit_(keys[:, :, span], values[:, :, span], decoded, chunk.start, rope):
                break
            num_placed += 1
            num_bytes += len(blob)
    except StoreUnavailable as error:  # the chunks placed so far are still good
        logger.warning("cache unavailable during fetch, %d of %d chunks placed: %s", num_placed, run, error)
        degraded = True
    finally:
        close = getattr(blobs, "close", None)
        if close is not None:
            close()  # stops a stream we no longer read
    if num_placed == 0:
        return AssembledContext(None, None, num_bytes_fetched=num_bytes, degraded=degraded)
    return AssembledContext(keys, values, chunks[num_placed - 1].end, num_placed, num_bytes_fetched=num_bytes,
                            degraded=degraded)


def prefetched(items: Iterator[T]) -> Iterator[T]:
    """Iterates `items` on a helper thread, ahead of the consumer.

    Receiving the next blob (network, parsing, checksum) then overlaps decoding and copying the current
    one; the queue holds at most the run's blobs, which the consumer copies out anyway. An exception
    raised by `items` reaches the consumer in order. When the consumer stops early, the helper stops
    after the item it is receiving and closes `items` (ending the stream) on its own thread.
    """
    ready: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def drain() -> None:
        try:
            for item in items:
                if stop.is_set():
                    break
                ready.put((item, None))
            ready.put((_DONE, None))
        except BaseException as error:  # handed to the consumer, never lost on this thread
            ready.put((_DONE, error))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    threading.Thread(target=drain, name="kvboost-fetch", daemon=True).start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
