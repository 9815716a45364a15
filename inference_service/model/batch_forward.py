"""Device work of a padded batch: broadcast the shared prefix, one left-padded prefill, batched decode steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from inference_service.model.attention_scope import engine_attention
from inference_service.model.kv_buffers import KVGeometry, LayerKV, PreallocatedLayer


def has_sliding_layers(config) -> bool:
    """True when some layer is not plain full attention (the padded layout would shift its window)."""
    return any(type(layer) is not DynamicLayer for layer in DynamicCache(config=config).layers)


@dataclass(slots=True)
class PaddedBatch:
    """K/V buffers of all rows and the 2D mask over them; the layout of row i in the buffers is

    [shared prefix: prefix_len][pads: pads[i]][suffix_i][generated tokens...]

    so every row's last prompt token sits at the same buffer index and one decode step serves all rows.
    """

    keys: torch.Tensor  # [layers, rows, kv_heads, capacity, head_dim]
    values: torch.Tensor
    attention_mask: torch.Tensor  # [rows, length] int64: 1 for real tokens, 0 for pads
    cache: DynamicCache  # views into keys/values, length = attention_mask.shape[1]
    prefix_len: int
    pads: list[int]  # left pads per row, in buffer order


def allocate_batch(config, geometry: KVGeometry, num_rows: int, capacity: int, prefix_keys: torch.Tensor | None,
                   prefix_values: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> PaddedBatch:
    """Buffers for num_rows rows, each holding a copy of the shared prefix (prefix_*: [layers, kv_heads, P, hd])."""
    shape = (geometry.num_layers, num_rows, geometry.num_kv_heads, capacity, geometry.head_dim)
    keys, values = torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)
    prefix_len = 0 if prefix_keys is None else prefix_keys.shape[2]
    if prefix_len:  # the prefix is broadcast: every row starts with the same K/V
        keys[:, :, :, :prefix_len].copy_(prefix_keys.unsqueeze(1).expand(-1, num_rows, -1, -1, -1))
        values[:, :, :, :prefix_len].copy_(prefix_values.unsqueeze(1).expand(-1, num_rows, -1, -1, -1))
    mask = torch.ones((num_rows, prefix_len), dtype=torch.long, device=device)
    return PaddedBatch(keys, values, mask, batch_cache(config, keys, values, prefix_len), prefix_len, [])


def batch_cache(config, keys: torch.Tensor, values: torch.Tensor, num_tokens: int) -> DynamicCache:
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        assert type(layer) is DynamicLayer, "padded batches need full-attention layers (see has_sliding_layers)"
        cache.layers[index] = PreallocatedLayer(keys[index], values[index], num_tokens)
    return cache


@torch.inference_mode()
def prefill_suffixes(model, batch: PaddedBatch, suffixes: Sequence[Sequence[int]], pad_token_id: int
                     ) -> tuple[torch.Tensor, list[LayerKV]]:
    """Runs every row's suffix after the shared prefix, left-padded to the longest one.

    Returns logits [rows, vocab] (float32) of each row's last prompt token and, per row, the K/V of its
    real suffix tokens (views that later steps never write into; pads left out).
    """
    num_rows, longest = len(suffixes), max(len(suffix) for suffix in suffixes)
    device, start = batch.keys.device, batch.prefix_len
    input_ids = torch.full((num_rows, longest), pad_token_id, dtype=torch.long, device=device)
    suffix_mask = torch.zeros((num_rows, longest), dtype=torch.long, device=device)
    # A pad's position is never seen by a real token (masked); start keeps it in range.
    position_ids = torch.full((num_rows, longest), start, dtype=torch.long, device=device)
    for row, suffix in enumerate(suffixes):
        num_pads = longest - len(suffix)
        batch.pads.append(num_pads)
        input_ids[row, num_pads:] = torch.tensor(suffix, dtype=torch.long, device=device)
        suffix_mask[row, num_pads:] = 1
        # Real tokens continue from the prefix, as they would in the row's own prompt.
        position_ids[row, num_pads:] = torch.arange(start, start + len(suffix), device=device)
    batch.attention_mask = torch.cat([batch.attention_mask, suffix_mask], dim=1)  # [rows, P + longest]
    with engine_attention(model.device):
        output = model(input_ids=input_ids, attention_mask=batch.attention_mask, position_ids=position_ids,
                       past_key_values=batch.cache, use_cache=True, logits_to_keep=1)
    end = start + longest
    row_kv = [[(layer.keys[row : row + 1, :, start + pads : end], layer.values[row : row + 1, :, start + pads : end])
               for layer in batch.cache.layers] for row, pads in enumerate(batch.pads)]
    return output.logits[:, -1].float(), row_kv


@torch.inference_mode()
def decode_rows(model, batch: PaddedBatch, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """One generated token per row (token_ids[i] at positions[i]); returns logits [rows, vocab] (float32)."""
    device = batch.keys.device
    num_rows = len(token_ids)
    batch.attention_mask = torch.cat(
        [batch.attention_mask, torch.ones((num_rows, 1), dtype=torch.long, device=device)], dim=1)
    with engine_attention(model.device):
        output = model(
            input_ids=torch.tensor(token_ids, device=device).view(num_rows, 1),
            attention_mask=batch.attention_mask,
            position_ids=torch.tensor(positions, device=device).view(num_rows, 1),
            past_key_values=batch.cache, use_cache=True,
        )
    return output.logits[:, -1].float()


def keep_rows(config, batch: PaddedBatch, slots: Sequence[int]) -> None:
    """Drops finished rows from the batch (copies the kept rows' buffers); slots: kept rows, in buffer order.

    Views handed out earlier (write-back) keep the old buffers alive and unchanged.
    """
    length = batch.attention_mask.shape[1]
    index = torch.tensor(list(slots), device=batch.keys.device)
    batch.keys = batch.keys.index_select(1, index)
    batch.values = batch.values.index_select(1, index)
    batch.attention_mask = batch.attention_mask.index_select(0, index)
    batch.pads = [batch.pads[slot] for slot in slots]
    batch.cache = batch_cache(config, batch.keys, batch.values, length)
