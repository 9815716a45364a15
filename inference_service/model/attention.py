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
    groups = getattr(module, "num_key_value_groups", 1)
    # One query token (a decode step): transformers already folds the query groups into the batch (pack_gqa),
    # which the CPU runs faster than grouped SDPA (bench/bench_batch_costs.py).
    if (not engine_call or query.device.type != "cpu" or groups == 1 or query.shape[2] == 1
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = query.shape[2] > 1 and attention_mask is None and (is_causal if is_causal is not None else True)
    return grouped_sdpa(query, key, value, attention_mask, dropout, scaling, causal), None


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
