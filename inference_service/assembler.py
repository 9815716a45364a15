"""Looks a prompt's chunks up, fetches the hits and places their K/V into one tensor per kind."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from inference_service.chunk_cache import CacheUnavailable, ChunkCache
from inference_service.codec import BlobError, decode_chunk
from inference_service.prompts import PromptPlan
from inference_service.runner import KVGeometry

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AssembledContext:
    """K/V for the first num_cached_tokens prompt tokens, ready for build_cache."""

    keys: torch.Tensor | None  # [layers, kv_heads, num_cached_tokens, head_dim]
    values: torch.Tensor | None
    num_cached_chunks: int = 0  # leading chunks whose K/V are all in keys/values
    num_recomputed_tokens: int = 0  # cached tokens whose K/V were recomputed by repair
    num_bytes_fetched: int = 0
    degraded: bool = False  # the cache became unreachable; chunks placed before that are still used
    content_hits: dict[int, bytes] = field(default_factory=dict)  # looked up, not reused yet

    @property
    def num_cached_tokens(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


def empty_context(degraded: bool = False) -> AssembledContext:
    return AssembledContext(None, None, degraded=degraded)


def assemble_context(
    cache: ChunkCache,
    namespace: bytes,
    prompt: PromptPlan,
    geometry: KVGeometry,
    device: torch.device,
    dtype: torch.dtype,
    with_content_hits: bool,
) -> AssembledContext:
    """Everything the cache can give for this prompt. Never raises for cache trouble: an unreachable
    cache gives an empty, degraded context, a bad or missing blob ends the reused run there.

    This is the one place hits become K/V: prefix hits now; content hits plug in here (repair).
    """
    content_keys = list(prompt.content_keys) if with_content_hits else None
    try:
        lookup = cache.lookup(namespace, list(prompt.prefix_keys), content_keys)
    except CacheUnavailable as error:
        logger.warning("cache unavailable, serving without it: %s", error)
        return empty_context(degraded=True)
    if lookup.prefix_run == 0:
        return AssembledContext(None, None, content_hits=lookup.content_hits)
    context = fetch_prefix_run(cache, prompt, lookup.prefix_run, geometry, device, dtype)
    context.content_hits = lookup.content_hits
    return context


def fetch_prefix_run(
    cache: ChunkCache,
    prompt: PromptPlan,
    run: int,
    geometry: KVGeometry,
    device: torch.device,
    dtype: torch.dtype,
) -> AssembledContext:
    """Fetches the first `run` chunks and decodes each blob straight into its slice of one tensor.

    A missing blob, one that fails to decode, or one that does not fit the chunk ends the run there.
    """
    chunks = prompt.chunks.chunks[:run]
    num_tokens = chunks[-1].end
    shape = (geometry.num_layers, geometry.num_kv_heads, num_tokens, geometry.head_dim)
    keys = torch.empty(shape, device=device, dtype=dtype)  # [layers, kv_heads, tokens, head_dim]
    values = torch.empty(shape, device=device, dtype=dtype)
    num_placed = num_bytes = 0
    degraded = False
    blobs = None
    try:
        blobs = cache.fetch(list(prompt.prefix_keys[:run]))
        for chunk, expected_key, (key, blob) in zip(chunks, prompt.prefix_keys, blobs):
            decoded = _decode_hit(expected_key, key, blob, chunk.start, len(chunk.token_ids), shape)
            if decoded is None:
                break
            keys[:, :, chunk.start : chunk.end].copy_(decoded.keys)
            values[:, :, chunk.start : chunk.end].copy_(decoded.values)
            num_placed += 1
            num_bytes += len(blob)
    except CacheUnavailable as error:  # the chunks placed so far are still good
        logger.warning("cache unavailable during fetch, %d of %d chunks placed: %s", num_placed, run, error)
        degraded = True
    finally:
        close = getattr(blobs, "close", None)
        if close is not None:
            close()  # stops a stream we no longer read
    if num_placed == 0:
        return AssembledContext(None, None, num_bytes_fetched=num_bytes, degraded=degraded)
    end = chunks[num_placed - 1].end
    return AssembledContext(keys[:, :, :end], values[:, :, :end], num_placed, num_bytes_fetched=num_bytes,
                            degraded=degraded)


def _decode_hit(expected_key: bytes, key: bytes, blob, start: int, num_tokens: int, shape: tuple[int, ...]):
    """The decoded chunk, or None (logged) when the blob cannot stand for this chunk."""
    if blob is None or key != expected_key:
        logger.info("chunk at position %d missing at fetch (evicted since lookup?)", start)
        return None
    try:
        decoded = decode_chunk(blob)
    except BlobError as error:
        logger.warning("chunk at position %d could not be decoded, recomputing from there: %s", start, error)
        return None
    header = decoded.header
    expected = (shape[0], shape[1], num_tokens, shape[3])
    if header.shape != expected or header.start_position != start:
        logger.warning("chunk at position %d has shape %s at %d, expected %s: recomputing from there",
                       start, header.shape, header.start_position, expected)
        return None
    return decoded
