"""Content hits anywhere in a prompt: fetch, re-rotate to their new positions, repair, one prefill."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inference_service.reuse.assembler import AssembledContext, report_corrupt
from inference_service.kv.blobs import decode_hit, place_hit_
from inference_service.store.protocol import StoreTimeout, StoreUnavailable, ChunkStore
from kvboost_keys.prompts import PromptPlan
from inference_service.kv.repair import APPROX, EXACT, MISSING, RepairOptions, repair_prefill
from inference_service.kv.rope import RopeParams
from inference_service.kv_memory.kv_buffers import KVGeometry, build_cache

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PlacedPrompt:
    """The whole prompt's K/V as the cache can give it, before repair."""

    key_buffer: torch.Tensor  # [layers, kv_heads, capacity, head_dim]; rows [0, S) that are MISSING are unset
    value_buffer: torch.Tensor
    status: torch.Tensor  # [S] int8 EXACT/APPROX/MISSING; the last token is always MISSING
    seams: torch.Tensor  # [n] starts of content-hit runs that do not continue a stored run
    num_content_chunks: int
    num_bytes_fetched: int
    degraded: bool = False  # the cache became unreachable while fetching content hits


@dataclass(slots=True)
class ContentPrefill:
    """A prefilled prompt that reused content hits: what decoding, stats and write-back need."""

    cache: object  # DynamicCache with all S positions
    first_logits: torch.Tensor  # [vocab] float32
    num_cached_tokens: int  # tokens whose K/V came from the cache (EXACT or APPROX before repair)
    num_recomputed_tokens: int  # APPROX tokens recomputed by the repair
    num_approximate_tokens: int  # APPROX tokens the repair kept: K/V computed under another prefix
    num_content_chunks: int
    num_bytes_fetched: int  # content-hit blobs only (the prefix run's bytes are in the context)
    key_buffer: torch.Tensor  # [layers, kv_heads, capacity, head_dim]; rows [0, S) repaired, held by `cache`
    value_buffer: torch.Tensor
    degraded: bool = False  # the cache became unreachable while fetching content hits
    repair_checked: bool = False  # cacheblend measured the risk
    repair_risk: float = 0.0  # the check layer's K/V error left unrepaired (share)
    fidelity_guard: bool = False  # the guard fired: every content-hit token was recomputed


def place_content_hits(
    cache: ChunkStore,
    prompt: PromptPlan,
    context: AssembledContext,
    geometry: KVGeometry,
    rope: RopeParams,
    buffers: tuple[torch.Tensor, torch.Tensor],
    overlap_tokens: int = 0,
) -> PlacedPrompt | None:
    """Lays every content hit after the prefix run (APPROX, keys re-rotated from the position they were
    computed at) into the context's buffers, next to the prefix run (EXACT). None when no content hit
    could be placed.

    overlap_tokens: the first N tokens of every stored run placed (each seam) are left MISSING, so they
    are recomputed with their real left context whatever the repair strategy; the stored run then
    starts N tokens later, where its K/V had N tokens of its own left context when it was computed.

    Never raises for cache trouble: a chunk that cannot be fetched, decoded or re-rotated stays
    MISSING; an unreachable cache keeps the hits placed before it and marks the context degraded
    (also when no hit was placed, so the caller's prefix-only fallback neither writes back nor
    reports the request as served with the cache).
    """
    # The request's slot; the prefix run, when there is one, already lies in the context's (the same slot).
    key_buffer, value_buffer = buffers if context.key_buffer is None else (context.key_buffer, context.value_buffer)
    device = key_buffer.device
    status = torch.full((prompt.num_tokens,), MISSING, dtype=torch.int8, device=device)
    status[: context.num_cached_tokens] = EXACT
    chunks = prompt.chunks.chunks
    # Content hits after the exact part (whole chunks and a partial chunk) only.
    hits = sorted((i, key) for i, key in context.content_hits.items() if chunks[i].start >= context.num_cached_tokens)
    seams: list[int] = []
    num_placed = num_bytes = 0
    degraded = False
    verify = not getattr(cache, "verifies_blobs", False)  # one checksum per blob is enough
    shape = (geometry.num_layers, geometry.num_kv_heads, 0, geometry.head_dim)
    previous: tuple[int, int] | None = None  # (chunk index, stored end position) of the last placed hit
    blobs = None
    try:
        blobs = cache.fetch([key for _, key in hits])
        lent = getattr(blobs, "lent", False)  # views into shared memory: decode each before taking the next
        for (index, expected_key), (key, blob) in zip(hits, blobs):
            chunk = prompt.chunks.chunks[index]
            decoded = decode_hit(expected_key, key, blob, chunk.start, len(chunk.token_ids), shape, verify,
                                 same_position=False, rope=rope, device=key_buffer.device, borrow=lent,
                                 on_corrupt=lambda key: report_corrupt(cache, key))
            # Keys rotated to their new positions; rows whose keys cannot be stay MISSING, so they are recomputed.
            span = slice(chunk.start, chunk.end)
            if decoded is None or not place_hit_(key_buffer[:, :, span], value_buffer[:, :, span], decoded, chunk.start,
                                                 rope):
                continue
            stored_start = decoded.header.start_position
            status[chunk.start : chunk.end] = APPROX
            # A chunk continues a run when it follows the previous hit both in the prompt and in storage.
            same_segment = index > 0 and prompt.chunks.chunks[index - 1].segment == chunk.segment
            if not (same_segment and previous == (index - 1, stored_start)):
                seams.append(chunk.start)
            previous = (index, stored_start + len(chunk.token_ids))
            num_placed += 1
            num_bytes += len(blob)
    except StoreTimeout as error:  # a slow transfer: the hits placed so far are used, the rest computed
        logger.warning("content fetch ran past its deadline, %d of %d hits placed: %s", num_placed, len(hits), error)
    except StoreUnavailable as error:
        logger.warning("cache unavailable during content fetch, %d of %d hits placed: %s", num_placed, len(hits), error)
        degraded = context.degraded = True
    finally:
        close = getattr(blobs, "close", None)
        if close is not None:
            close()  # ends a stream or a read transaction we no longer read
    if num_placed == 0:
        return None
    if overlap_tokens:
        for seam in seams:
            window = status[seam : seam + overlap_tokens]
            window[window == APPROX] = MISSING
        seams = [seam + overlap_tokens for seam in seams]  # where the reused part of each run now starts
    status[-1] = MISSING  # the last token always runs, so there are logits
    seams_tensor = torch.tensor([s for s in seams if s < prompt.num_tokens], dtype=torch.long, device=device)
    return PlacedPrompt(key_buffer, value_buffer, status, seams_tensor, num_placed, num_bytes, degraded)


def prefill_with_content_hits(
    model,
    cache: ChunkStore,
    prompt: PromptPlan,
    context: AssembledContext,
    geometry: KVGeometry,
    rope: RopeParams | None,
    options: RepairOptions,
    buffers: tuple[torch.Tensor, torch.Tensor],
    overlap_tokens: int = 0,
) -> ContentPrefill | None:
    """Places the content hits after the prefix run and prefills the rest with repair.

    buffers: the request's slot (keys, values [layers, kv_heads, capacity, head_dim]). Returns None when there is nothing to
    reuse by content (no RoPE parameters, no placeable hit); the caller then prefills as for prefix
    hits only, with the context as it is.
    """
    if rope is None or not context.content_hits:
        return None
    placed = place_content_hits(cache, prompt, context, geometry, rope, buffers, overlap_tokens)
    if placed is None:
        return None
    num_tokens = prompt.num_tokens
    input_ids = torch.tensor([prompt.token_ids], device=model.device)
    # Per-layer views [1, kv_heads, S, head_dim] of the buffers: repair writes recomputed rows into them.
    layer_keys = [placed.key_buffer[i : i + 1, :, :num_tokens] for i in range(geometry.num_layers)]
    layer_values = [placed.value_buffer[i : i + 1, :, :num_tokens] for i in range(geometry.num_layers)]
    result = repair_prefill(model, input_ids, layer_keys, layer_values, placed.status, options, placed.seams)
    return ContentPrefill(
        # The engine's own cache over the buffers, with their room for decoding (result.cache is not needed).
        cache=build_cache(model.config, placed.key_buffer, placed.value_buffer, num_tokens),
        first_logits=result.last_logits,
        num_cached_tokens=int((placed.status != MISSING).sum()),
        num_recomputed_tokens=result.num_recomputed,
        num_approximate_tokens=int((placed.status == APPROX).sum()) - result.num_recomputed,
        num_content_chunks=placed.num_content_chunks,
        num_bytes_fetched=placed.num_bytes_fetched,
        key_buffer=placed.key_buffer,
        value_buffer=placed.value_buffer,
        degraded=placed.degraded,
        repair_checked=options.strategy == "cacheblend",
        repair_risk=result.risk,
        fidelity_guard=result.guarded,
    )
