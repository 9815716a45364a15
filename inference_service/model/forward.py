"""The model's forward passes over one request's own cache: a prefill, and one token decoded alone."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from inference_service.model.attention import engine_call_kwargs, live_causal_mask
from inference_service.kv_memory.kv_buffers import LayerKV, PreallocatedLayer


def prefill(model, cache: DynamicCache, token_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, LayerKV]:
    """Runs the live tokens after `start` cached ones; returns the last token's logits and their K/V.

    token_ids: [n] at positions start .. start+n-1. Returns logits [vocab] (float32) and, per layer,
    the K/V of these n tokens (views; nothing later writes into them).
    """
    logits, new_kv = _prefill(model, cache, token_ids, start, logits_to_keep=1)
    return logits[-1], new_kv


def prefill_scored(model, cache: DynamicCache, token_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, LayerKV]:
    """prefill() that keeps every token's logits: [n, vocab] (float32), row i predicting token i + 1."""
    return _prefill(model, cache, token_ids, start, logits_to_keep=0)


@torch.inference_mode()
def prefill_padded(model, cache: DynamicCache, token_ids: torch.Tensor, start: int, num_real: int) -> torch.Tensor:
    """prefill() of a fixed-shape piece: token_ids [n] at start .. start+n-1, of which the first num_real are the
    prompt's and the rest pads (causal attention: no real row sees them). Returns the last real token's logits
    [vocab] (float32); the cache holds start + num_real positions after it (full-attention layers only)."""
    index = torch.tensor([num_real - 1], device=token_ids.device)
    logits, _ = _prefill(model, cache, token_ids, start, logits_to_keep=index)
    for layer in cache.layers:
        layer.truncate(start + num_real)
    return logits[-1]


@torch.inference_mode()
def _prefill(model, cache: DynamicCache, token_ids: torch.Tensor, start: int,
             logits_to_keep: int | torch.Tensor) -> tuple[torch.Tensor, LayerKV]:
    num_tokens = token_ids.shape[0]
    sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    for layer in sliding:  # keep every new token's K/V until they are read below
        layer.activate_past_recording()
    position_ids = torch.arange(start, start + num_tokens, device=token_ids.device).unsqueeze(0)
    output = model(input_ids=token_ids.unsqueeze(0), position_ids=position_ids, past_key_values=cache,
                   attention_mask=live_causal_mask(model, token_ids, start, not _all_full_attention(cache)), use_cache=True,
                   logits_to_keep=logits_to_keep, **engine_call_kwargs())
    new_kv = [(layer.keys[:, :, -num_tokens:], layer.values[:, :, -num_tokens:]) for layer in cache.layers]
    for layer in sliding:
        layer.record_past = False
        layer.keys = layer.keys[:, :, -layer.sliding_window + 1 :]
        layer.values = layer.values[:, :, -layer.sliding_window + 1 :]
    return output.logits[0].float(), new_kv  # [kept tokens, vocab]


def _all_full_attention(cache: DynamicCache) -> bool:
    """Every layer is plain full attention over the slot's buffers (build_cache's; any other kind, sliding window or
    chunked, keeps its own type and its own mask)."""
    return all(type(layer) is PreallocatedLayer for layer in cache.layers)


@torch.inference_mode()
def decode_alone(model, cache: DynamicCache, token_id: torch.Tensor, position: int) -> torch.Tensor:
    """One generated token through the model, for one request alone (the rows of a sliding-window model decode
    this way: pads would shift the window); token_id: [] at `position`. Returns logits [vocab] (float32)."""
    position_ids = torch.tensor([[position]], device=token_id.device)
    output = model(input_ids=token_id.view(1, 1), position_ids=position_ids, past_key_values=cache, use_cache=True,
                   **engine_call_kwargs())
    return output.logits[0, -1].float()
