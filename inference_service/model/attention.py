"""The engine's attention: a registered transformers attention function, chosen per forward call by a keyword."""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ENGINE_ATTENTION = "kvboost_sdpa"  # the name a model's attention is switched to by use_engine_attention
ENGINE_CALL = "kvboost_engine_call"  # keyword that only the engine's forwards pass: True selects grouped SDPA


def engine_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' own SDPA attention, unless the call is one of the engine's own forwards on the CPU.

    There SDPA groups query heads itself (enable_gqa) even with a mask (a prefill after a cache hit, a
    batched decode): transformers would copy every cached K/V head per query group first (repeat_kv), most
    of the attention cost of a short suffix over a long cached prefix. The result is bit-identical on CPU
    (tests/inference_service/model/test_attention.py); CUDA keeps transformers' choice.
    query: [batch, heads, q, dim]; key, value: [batch, kv_heads, kv, dim]; attention_mask: bool [batch, 1, q, kv].
    """
    engine_call = kwargs.pop(ENGINE_CALL, False)
    if attention_mask is LIVE_CAUSAL:
        return live_causal_attention(query, key, value, scaling), None
    groups = getattr(module, "num_key_value_groups", 1)
    # One query token (a decode step): transformers already folds the query groups into the batch (pack_gqa),
    # which the CPU runs faster than grouped SDPA (docs/benchmarks.md, "What a step costs now").
    if (not engine_call or query.device.type != "cpu" or groups == 1 or query.shape[2] == 1
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = query.shape[2] > 1 and attention_mask is None and (is_causal if is_causal is not None else True)
    return grouped_sdpa(query, key, value, attention_mask, dropout, scaling, causal), None


# The attention_mask an engine prefill passes instead of a mask when its rows follow cached positions (see
# live_causal_mask): a 4D tensor, so transformers takes it as already built and builds none; empty, so any attention
# function other than engine_attention_forward that were handed it would fail rather than attend to everything.
LIVE_CAUSAL = torch.empty((1, 1, 0, 0), dtype=torch.bool)
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def live_causal_mask(model, token_ids: torch.Tensor, start: int, other_layer_kinds: bool) -> torch.Tensor | None:
    """LIVE_CAUSAL for a prefill of token_ids after `start` cached positions that live_causal_attention can run (the
    engine's attention on the CPU in float32, every layer full attention: other_layer_kinds False); None:
    transformers builds the mask."""
    if (start == 0 or token_ids.shape[-1] < 2 or token_ids.device.type != "cpu" or other_layer_kinds
            or _FLASH_WITH_LSE is None or model.dtype != torch.float32
            or getattr(model.config, "_attn_implementation", None) != ENGINE_ATTENTION):
        return None
    return LIVE_CAUSAL


def live_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          scaling: float | None) -> torch.Tensor:
    """Causal attention of the last q positions over all kv (the row i sees keys up to kv - q + i) with no mask:
    SDPA's own causal mask is aligned top-left, so the cached keys and the live ones run as two flash attentions
    (every row sees every cached key; the live keys causally) merged by their log-sum-exps. The cached part folds
    each K/V head's query heads into its rows, so no K/V head is copied; only the q live keys are repeated.
    query: [batch, heads, q, dim]; key, value: [batch, kv_heads, kv, dim], kv > q. Returns [batch, q, heads, dim]."""
    batch, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_cached = key.shape[1], key.shape[2] - num_queries
    groups = num_heads // num_kv_heads
    assert num_cached > 0, f"live causal attention follows cached positions ({key.shape[2]} keys, {num_queries} rows)"
    folded = query.reshape(batch, num_kv_heads, groups * num_queries, head_dim)  # head h reads K/V head h // groups
    cached_out, cached_lse = _FLASH_WITH_LSE(folded, key[:, :, :num_cached], value[:, :, :num_cached], scale=scaling)
    cached_out = cached_out.reshape(batch, num_heads, num_queries, head_dim)
    cached_lse = cached_lse.reshape(batch, num_heads, num_queries)
    live_keys = key[:, :, num_cached:].repeat_interleave(groups, dim=1)
    live_values = value[:, :, num_cached:].repeat_interleave(groups, dim=1)
    live_out, live_lse = _FLASH_WITH_LSE(query, live_keys, live_values, is_causal=True, scale=scaling)
    # softmax over both parts: each part's output weighted by its share of the exponentials
    top = torch.maximum(cached_lse, live_lse)
    cached_weight = torch.exp(cached_lse - top).unsqueeze(-1)  # [batch, heads, q, 1]
    live_weight = torch.exp(live_lse - top).unsqueeze(-1)
    output = (cached_out * cached_weight + live_out * live_weight) / (cached_weight + live_weight)
    return output.transpose(1, 2).contiguous()


def grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                 dropout: float, scaling: float | None, causal: bool) -> torch.Tensor:
    """SDPA over grouped K/V heads; returns [batch, q, heads, dim] as transformers' attention functions do."""
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=True)
    return output.transpose(1, 2).contiguous()


def use_engine_attention(model) -> None:
    """Switches a model that runs transformers' SDPA to ENGINE_ATTENTION (the same masks, the same results for
    every call that does not pass ENGINE_CALL); other implementations are left as they are."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(ENGINE_ATTENTION, engine_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ENGINE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(ENGINE_ATTENTION)


def engine_call_kwargs() -> dict[str, bool]:
    """Keyword arguments every engine forward passes to the model (read by engine_attention_forward only)."""
    return {ENGINE_CALL: True}
