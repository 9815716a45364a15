"""Content hits anywhere in a prompt: fetch, re-rotate to their new positions, repair, one prefill."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inference_service.assembler import AssembledContext
from inference_service.chunk_cache import ChunkCache
from inference_service.codec import BlobError, decode_chunk
from inference_service.prompts import PromptPlan
from inference_service.repair import APPROX, EXACT, MISSING, RepairOptions, exact_prefix_length, repair_prefill
from inference_service.rope import RopeParams, UnsupportedRope, rerotate_keys
from inference_service.runner import KVGeometry
from inference_service.writeback import PendingChunks

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PlacedPrompt:
    """The whole prompt's K/V as the cache can give it, before repair."""

    keys: torch.Tensor  # [layers, kv_heads, S, head_dim]; MISSING rows are zeros
    values: torch.Tensor
    status: torch.Tensor  # [S] int8 EXACT/APPROX/MISSING; the last token is always MISSING
    seams: torch.Tensor  # [n] starts of content-hit runs that do not continue a stored run
    num_content_chunks: int
    num_bytes_fetched: int


@dataclass(slots=True)
class ContentPrefill:
    """A prefilled prompt that reused content hits: what decoding, stats and write-back need."""

    cache: object  # DynamicCache with all S positions
    first_logits: torch.Tensor  # [vocab] float32
    num_cached_tokens: int  # tokens whose K/V came from the cache (EXACT or APPROX before repair)
    num_recomputed_tokens: int  # APPROX tokens recomputed by the repair
    num_content_chunks: int
    num_bytes_fetched: int  # content-hit blobs only (the prefix run's bytes are in the context)
    keys: torch.Tensor  # [layers, kv_heads, S, head_dim] after repair
    values: torch.Tensor
    num_exact_tokens: int  # tokens [0, n) have exact K/V: only chunks inside may be stored


def place_content_hits(
    cache: ChunkCache,
    prompt: PromptPlan,
    context: AssembledContext,
    geometry: KVGeometry,
    rope: RopeParams,
    device: torch.device,
    dtype: torch.dtype,
) -> PlacedPrompt | None:
    """Lays the prefix run (EXACT) and every content hit after it (APPROX, keys re-rotated from the
    position they were computed at) into S-long tensors. None when no content hit could be placed.

    Never raises for a bad blob: a chunk that cannot be fetched, decoded or re-rotated stays MISSING.
    """
    num_tokens = prompt.num_tokens
    shape = (geometry.num_layers, geometry.num_kv_heads, num_tokens, geometry.head_dim)
    keys = torch.zeros(shape, device=device, dtype=dtype)  # [layers, kv_heads, S, head_dim]
    values = torch.zeros(shape, device=device, dtype=dtype)
    status = torch.full((num_tokens,), MISSING, dtype=torch.int8, device=device)
    num_exact = context.num_cached_tokens
    if num_exact:
        keys[:, :, :num_exact], values[:, :, :num_exact] = context.keys, context.values
        status[:num_exact] = EXACT
    hits = {i: key for i, key in context.content_hits.items() if i >= context.num_cached_chunks}
    seams: list[int] = []
    num_placed = num_bytes = 0
    previous_end: tuple[int, int] | None = None  # (chunk index, stored end position) of the last placed hit
    for index, (key, blob) in zip(sorted(hits), cache.fetch([hits[i] for i in sorted(hits)])):
        chunk = prompt.chunks.chunks[index]
        decoded = _decode_content_hit(key, hits[index], blob, chunk.start, len(chunk.token_ids), shape)
        if decoded is None:
            continue
        stored_start = decoded.header.start_position
        from_positions = torch.arange(stored_start, stored_start + len(chunk.token_ids), device=device)
        to_positions = torch.arange(chunk.start, chunk.end, device=device)
        try:
            moved = rerotate_keys(decoded.keys.to(device, dtype), from_positions, to_positions, rope)
        except UnsupportedRope as error:
            logger.info("content hit at position %d not reused: %s", chunk.start, error)
            continue
        keys[:, :, chunk.start : chunk.end] = moved
        values[:, :, chunk.start : chunk.end] = decoded.values.to(device, dtype)
        status[chunk.start : chunk.end] = APPROX
        # A chunk continues a run when it follows the previous hit in the prompt and in storage.
        continues = previous_end == (index - 1, stored_start) and prompt.chunks.chunks[index - 1].segment == chunk.segment
        if not continues:
            seams.append(chunk.start)
        previous_end = (index, stored_start + len(chunk.token_ids))
        num_placed += 1
        num_bytes += len(blob)
    if num_placed == 0:
        return None
    status[-1] = MISSING  # the last token always runs, so there are logits
    seams_tensor = torch.tensor(seams, dtype=torch.long, device=device)
    return PlacedPrompt(keys, values, status, seams_tensor, num_placed, num_bytes)


def prefill_with_content_hits(
    model,
    cache: ChunkCache,
    prompt: PromptPlan,
    context: AssembledContext,
    geometry: KVGeometry,
    rope: RopeParams | None,
    options: RepairOptions,
) -> ContentPrefill | None:
    """Places the content hits after the prefix run and prefills the rest with repair.

    Returns None when there is nothing to reuse by content (no RoPE parameters, no placeable hit);
    the caller then prefills as for prefix hits only.
    """
    if rope is None or not context.content_hits:
        return None
    placed = place_content_hits(cache, prompt, context, geometry, rope, model.device, model.dtype)
    if placed is None:
        return None
    input_ids = torch.tensor([prompt.token_ids], device=model.device)
    # Per-layer views [1, kv_heads, S, head_dim]: repair writes recomputed rows into placed.keys/values.
    layer_keys, layer_values = list(placed.keys.unsqueeze(1)), list(placed.values.unsqueeze(1))
    result = repair_prefill(model, input_ids, layer_keys, layer_values, placed.status, options, placed.seams)
    return ContentPrefill(
        cache=result.cache,
        first_logits=result.last_logits,
        num_cached_tokens=int((placed.status != MISSING).sum()),
        num_recomputed_tokens=result.num_recomputed,
        num_content_chunks=placed.num_content_chunks,
        num_bytes_fetched=placed.num_bytes_fetched,
        keys=placed.keys,
        values=placed.values,
        num_exact_tokens=exact_prefix_length(placed.status),
    )


def exact_pending_chunks(
    namespace: bytes, prompt: PromptPlan, context: AssembledContext, prefilled: ContentPrefill, request_id: str = ""
) -> PendingChunks:
    """The new chunks safe to store: after the prefix run and before the first content hit. Every
    later token attended to approximate K/V, so its chunk must not be stored under a prefix key."""
    first = context.num_cached_chunks
    chunks = prompt.chunks.chunks
    last = first
    while last < len(chunks) and chunks[last].end <= prefilled.num_exact_tokens:
        last += 1
    start = chunks[first].start if first < last else 0
    new_kv = [
        (layer_keys[None, :, start:], layer_values[None, :, start:])
        for layer_keys, layer_values in zip(prefilled.keys, prefilled.values)
    ]
    return PendingChunks(namespace, chunks[first:last], prompt.prefix_keys[first:last],
                         prompt.content_keys[first:last], new_kv, start, request_id=request_id)


def _decode_content_hit(key: bytes, expected_key: bytes, blob, start: int, num_tokens: int, shape: tuple[int, ...]):
    """The decoded chunk, or None (logged) when the blob cannot stand for this chunk at any position."""
    if blob is None or key != expected_key:
        logger.info("content hit at position %d missing at fetch (evicted since lookup?)", start)
        return None
    try:
        decoded = decode_chunk(blob)
    except BlobError as error:
        logger.warning("content hit at position %d could not be decoded, recomputing it: %s", start, error)
        return None
    expected = (shape[0], shape[1], num_tokens, shape[3])
    if decoded.header.shape != expected:
        logger.warning("content hit at position %d has shape %s, expected %s: recomputing it",
                       start, decoded.header.shape, expected)
        return None
    return decoded
