"""A sequence's prefill on the model: its prompt looked up into its slot, its pieces run, its new chunks named."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Sequence as Seq

import torch

from inference_service.reuse.assembler import assemble_context, empty_context
from inference_service.reuse.content_reuse import prefill_with_content_hits
from inference_service.engine_parts.logprobs import prompt_logprobs
from inference_service.engine_parts.planning import needs_repair, new_chunks, repair_options
from inference_service.model.batch_forward import BatchWorkspace, PrefillRow, has_sliding_layers, prefill_rows
from inference_service.model.forward import prefill, prefill_padded, prefill_scored
from inference_service.kv_memory.kv_buffers import build_cache

if TYPE_CHECKING:  # annotations only: prefill works on the sequences the executor hands it
    from inference_service.engine.request import EngineRequest

Buffers = tuple[torch.Tensor, torch.Tensor]  # a slot's keys, values: [layers, kv_heads, capacity, head_dim]


def invariant_prefill_refusal(model_config) -> str:
    """Why invariant prefill cannot run this model ('' when it can): its pads would enter a sliding window, or move
    a RoPE that scales with the longest position seen."""
    if has_sliding_layers(model_config):
        return "this model has sliding-window layers, which the padding of a prompt's last chunk would enter"
    rope = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind in ("dynamic", "longrope"):
        return f"this model's RoPE ({kind}) scales with the longest position seen, which the padding would move"
    return ""


def start(seq: EngineRequest, buffers: Buffers) -> None:
    """Places what the store holds for the prompt into the slot; sets how much is in place and whether the rest
    must run in one piece (repair of content hits, every prompt token's logprob)."""
    parts, prompt = seq.parts, seq.prompt
    looks_up = seq.mode != "baseline" and seq.params.prompt_logprobs is None and seq.warm is None
    started = time.perf_counter()
    recompute_when_faster = parts.config.recompute_when_faster
    if recompute_when_faster is None:
        recompute_when_faster = parts.device.type == "cuda"
    early = seq.current_lookup()
    seq.context = (assemble_context(parts.store, parts.namespace, prompt, buffers, seq.mode == "chunk_kv_reuse",
                                    parts.key_rope, parts.l0, parts.counters.choose_load if recompute_when_faster
                                    else None, early, parts.host) if looks_up else empty_context())
    if seq.context.num_lookups:
        parts.counters.add_step_loop_lookups(seq.context.num_lookups)
    if seq.context.num_cached_tokens:  # the load rate: bytes in place / time from the Lookup to the last one placed
        keys = buffers[0]
        per_token = 2 * keys.shape[0] * keys.shape[1] * keys.shape[3] * keys.element_size()
        lookup_seconds = seq.early_lookup_seconds if early is not None else 0.0  # asked before: its time counts too
        parts.counters.add_load(seq.context.num_cached_tokens * per_token,
                                time.perf_counter() - started + lookup_seconds)
    for load in seq.context.tier_loads:  # each tier's own rate (L0, the daemon's map or its Fetch stream)
        parts.counters.add_tier_load(load)
    seq.whole = seq.params.prompt_logprobs is not None or needs_repair(seq.mode, seq.context)
    # The last prompt token runs when its logits choose the first new token.
    place(seq, buffers, min(seq.context.num_cached_tokens, prompt.num_tokens - int(seq.need_logits)))


def place(seq: EngineRequest, buffers: Buffers, num_in_place: int) -> None:
    """The first num_in_place prompt tokens are in the slot: the prefill goes on from there (with invariant
    prefill, from the piece boundary at or before it: that piece's forward is the uncached prompt's)."""
    config = seq.parts.config
    if config.invariant_prefill and num_in_place < seq.prompt.num_tokens and not seq.whole:
        num_in_place -= num_in_place % config.invariant_piece_tokens
    seq.num_cached = num_in_place
    seq.cache = build_cache(seq.parts.model.config, *buffers, num_in_place)
    seq.state.num_computed, seq.state.whole = num_in_place, seq.whole
    if num_in_place == seq.prompt.num_tokens:  # a warm-up the store already holds whole: nothing runs
        finish(seq, buffers, None)


@torch.inference_mode()
def run_piece(seq: EngineRequest, buffers: Buffers, num_tokens: int) -> int:
    """Runs the next num_tokens prompt tokens (all the rest for a whole prefill); returns how many ran."""
    if seq.whole:
        return _run_whole(seq, buffers)
    if seq.parts.config.invariant_prefill:
        return _run_chunks(seq, buffers, num_tokens)
    begin = seq.state.num_computed
    end = min(begin + num_tokens, seq.prompt.num_tokens)
    live = torch.tensor(seq.prompt.token_ids[begin:end], device=seq.parts.device)
    logits, new_kv = prefill(seq.parts.model, seq.cache, live, begin)
    _keep_sliding_layers(seq, buffers, new_kv, begin)
    seq.state.num_computed = end
    if end == seq.prompt.num_tokens:
        finish(seq, buffers, logits)
    return end - begin


def _run_chunks(seq: EngineRequest, buffers: Buffers, num_tokens: int) -> int:
    """Invariant prefill: the next pieces covering at least num_tokens prompt tokens, one forward each of exactly
    invariant_piece_tokens rows (whole chunks) at positions aligned to as many, the prompt's last piece padded after
    its end. Every piece's forward then has the same shapes, the same kernels and the same inputs (a row never sees
    the rows after it) whether the prompt was cut here or there, cached in part or not at all; returns how many
    prompt tokens ran."""
    size, prompt = seq.parts.config.invariant_piece_tokens, seq.prompt
    begin = seq.state.num_computed
    assert begin % size == 0, f"invariant prefill starts at a piece boundary, not at {begin}"
    stop = min(begin + -(-max(num_tokens, 1) // size) * size, prompt.num_tokens)
    logits = None
    for start in range(begin, stop, size):
        end = min(start + size, prompt.num_tokens)
        token_ids = list(prompt.token_ids[start:end])
        token_ids += [token_ids[-1]] * (size - len(token_ids))  # pads: any id; no real row attends to them
        logits = prefill_padded(seq.parts.model, seq.cache, torch.tensor(token_ids, device=seq.parts.device),
                                start, end - start)
        seq.state.num_computed = end
    if stop == prompt.num_tokens:
        finish(seq, buffers, logits)
    return stop - begin


@torch.inference_mode()
def run_together(seqs: Seq[EngineRequest], buffers: Seq[Buffers], pad_token_id: int,
                 workspace: BatchWorkspace | None = None) -> None:
    """The rest of every sequence's prompt in ONE forward (full-attention models, batch buffers from `workspace`);
    each is then prefilled."""
    if len(seqs) == 1:
        run_piece(seqs[0], buffers[0], seqs[0].state.num_remaining)
        return
    rows = [PrefillRow(*slot, seq.state.num_computed, seq.prompt.token_ids[seq.state.num_computed:])
            for seq, slot in zip(seqs, buffers)]
    logits = prefill_rows(seqs[0].parts.model, rows, pad_token_id, workspace)
    for seq, slot, row_logits in zip(seqs, buffers, logits):
        seq.cache = build_cache(seq.parts.model.config, *slot, seq.prompt.num_tokens)
        finish(seq, slot, row_logits)


def runs_in_decode_step(seq: EngineRequest) -> bool:
    """Whether the prompt's one token left (a prompt cached to its last token) runs as a row of the step's decode
    forward, beside the decoding rows, instead of a prefill forward of its own: the same one-token forward over the
    slot (the decode step is bitwise the model's forward, its start-up probe checks it), with no forward of its
    own. Not for invariant prefill (its pieces are whole chunks), a whole prefill, or a warm-up (no logits)."""
    return (seq.state.num_computed is not None and seq.state.num_remaining == 1 and not seq.whole
            and seq.warm is None and not seq.parts.config.invariant_prefill)


def finish(seq: EngineRequest, buffers: Buffers, first_logits: torch.Tensor | None) -> None:
    """The whole prompt is in the slot: keeps the first token's logits and names the chunks to store."""
    parts, prompt = seq.parts, seq.prompt
    seq.first_logits = first_logits
    seq.state.num_computed = prompt.num_tokens
    keys, values = buffers
    new_kv = [(keys[layer : layer + 1, :, seq.num_cached : prompt.num_tokens],
               values[layer : layer + 1, :, seq.num_cached : prompt.num_tokens])
              for layer in range(parts.geometry.num_layers)]
    # With invariant prefill a whole prefill (every prompt token's logprob, a content-hit fallback) ran in one
    # forward, not in whole chunks: its K/V are right for this answer but are not the chunks' invariant ones.
    stores = (seq.warm is not None or seq.mode != "baseline") and not (parts.config.invariant_prefill and seq.whole)
    if stores and not seq.context.degraded and seq.num_cached < prompt.num_tokens:
        seq.pending = new_chunks(parts, prompt, seq.context, new_kv, seq.num_cached, buffers, seq.request_id)
        if seq.warm is not None and seq.warm.pin:
            seq.pending = dataclasses.replace(seq.pending, pin=True)


def _run_whole(seq: EngineRequest, buffers: Buffers) -> int:
    parts, prompt, context = seq.parts, seq.prompt, seq.context
    num_before = seq.state.num_computed
    if needs_repair(seq.mode, context):
        reused = prefill_with_content_hits(parts.model, parts.store, prompt, context, parts.geometry,
                                           parts.content_rope, repair_options(parts, seq.params), buffers,
                                           overlap_tokens=parts.config.overlap_tokens)
        if reused is not None:
            context.num_recomputed_tokens = reused.num_recomputed_tokens
            context.approximate, context.num_approximate_tokens = True, reused.num_approximate_tokens
            context.repair_checked, context.repair_risk = reused.repair_checked, reused.repair_risk
            context.fidelity_guard = reused.fidelity_guard
            context.num_bytes_fetched += reused.num_bytes_fetched
            context.num_cached_chunks += reused.num_content_chunks
            context.degraded = reused.degraded
            seq.num_cached, seq.cache, seq.first_logits = reused.num_cached_tokens, reused.cache, reused.first_logits
            seq.state.num_computed = prompt.num_tokens
            # Nothing of it is stored: the K/V after the first content hit attended to approximate ones, and even
            # those before it came through the repair's forward, which rounds apart from the model's own (close,
            # not bitwise): stored under prefix keys they would change a later exact answer.
            seq.pending = None
            return prompt.num_tokens - num_before
    live = torch.tensor(prompt.token_ids[num_before:], device=parts.device)
    if seq.params.prompt_logprobs is None:
        first_logits, new_kv = prefill(parts.model, seq.cache, live, num_before)
    else:  # nothing was looked up: the whole prompt runs, every token's logits kept
        all_logits, new_kv = prefill_scored(parts.model, seq.cache, live, num_before)  # [tokens, vocab]
        first_logits = all_logits[-1]
        seq.prompt_logprobs = tuple(prompt_logprobs(parts.tokenizer, all_logits, prompt.token_ids,
                                                    seq.params.prompt_logprobs))
    _keep_sliding_layers(seq, buffers, new_kv, num_before)
    finish(seq, buffers, first_logits)
    return prompt.num_tokens - num_before


def _keep_sliding_layers(seq: EngineRequest, buffers: Buffers, new_kv, begin: int) -> None:
    """Sliding-window layers keep only their window in the cache: their K/V go into the slot too, so the
    write-back and the copies for n completions find every token there."""
    keys, values = buffers
    for layer, cache_layer in enumerate(seq.cache.layers):
        if getattr(cache_layer, "is_sliding", False):
            layer_keys, layer_values = new_kv[layer]
            end = begin + layer_keys.shape[2]
            keys[layer, :, begin:end].copy_(layer_keys[0])
            values[layer, :, begin:end].copy_(layer_values[0])
