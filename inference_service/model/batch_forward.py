"""Several requests' prefill pieces in one forward, and whether a model can be batched at all."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from inference_service.model.attention import engine_call_kwargs
from inference_service.model.kv_buffers import PreallocatedLayer


def has_sliding_layers(config) -> bool:
    """True when some layer is not plain full attention (a padded layout would shift its window)."""
    return any(type(layer) is not DynamicLayer for layer in DynamicCache(config=config).layers)


def batch_cache(config, keys: torch.Tensor, values: torch.Tensor, num_tokens: int) -> DynamicCache:
    """A cache over batch buffers keys, values: [layers, rows, kv_heads, capacity, head_dim], num_tokens held."""
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        assert type(layer) is DynamicLayer, "batched forwards need full-attention layers (see has_sliding_layers)"
        cache.layers[index] = PreallocatedLayer(keys[index], values[index], num_tokens)
    return cache


@dataclass(slots=True)
class PrefillRow:
    """One request's prefill piece: its buffers [layers, kv_heads, capacity, head_dim] hold `start` cached
    tokens; token_ids run at positions start, start + 1, ..."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int
    token_ids: Sequence[int]


@torch.inference_mode()
def prefill_rows(model, rows: Sequence[PrefillRow], pad_token_id: int = 0) -> torch.Tensor:
    """Runs every row's tokens after its own cached ones in ONE forward; returns each row's last-token logits
    [rows, vocab] (float32) and writes the new K/V into each row's buffers after its cached tokens.

    Layout of row i in the temporary batch (C = longest cached run, S = longest piece):

        [unread: mask 0][cached_i: mask 1, ends at C][pads: mask 0][tokens_i: mask 1, ends at C + S]

    so every row's last token sits in the last column; the mask keeps pads and other rows out of it.
    """
    assert rows and all(row.token_ids for row in rows), "prefill_rows needs rows with tokens to run"
    first = rows[0].keys
    num_layers, num_kv_heads, _, head_dim = first.shape
    num_rows = len(rows)
    longest_cached = max(row.start for row in rows)
    longest = max(len(row.token_ids) for row in rows)
    width = longest_cached + longest
    shape = (num_layers, num_rows, num_kv_heads, width, head_dim)
    keys = torch.empty(shape, dtype=first.dtype, device=first.device)
    values = torch.empty(shape, dtype=first.dtype, device=first.device)
    mask = torch.zeros((num_rows, width), dtype=torch.long, device=first.device)
    input_ids = torch.full((num_rows, longest), pad_token_id, dtype=torch.long, device=first.device)
    positions = torch.zeros((num_rows, longest), dtype=torch.long, device=first.device)
    for index, row in enumerate(rows):
        begin = longest_cached - row.start
        # The columns before the row are masked, but a masked column still enters the product: zeros, not NaN.
        keys[:, index, :, :begin].zero_()
        values[:, index, :, :begin].zero_()
        keys[:, index, :, begin:longest_cached].copy_(row.keys[:, :, : row.start])
        values[:, index, :, begin:longest_cached].copy_(row.values[:, :, : row.start])
        mask[index, begin:longest_cached] = 1
        num_pads = longest - len(row.token_ids)
        mask[index, longest_cached + num_pads :] = 1
        input_ids[index, num_pads:] = torch.tensor(list(row.token_ids), dtype=torch.long, device=first.device)
        # A pad's position is never seen by a real token (masked); the row's start keeps it in range.
        positions[index] = row.start
        positions[index, num_pads:] = torch.arange(row.start, row.start + len(row.token_ids), device=first.device)
    cache = batch_cache(model.config, keys, values, longest_cached)
    output = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                   use_cache=True, logits_to_keep=1, **engine_call_kwargs())
    for index, row in enumerate(rows):
        count = len(row.token_ids)
        row.keys[:, :, row.start : row.start + count].copy_(keys[:, index, :, width - count :])
        row.values[:, :, row.start : row.start + count].copy_(values[:, index, :, width - count :])
    return output.logits[:, -1].float()
