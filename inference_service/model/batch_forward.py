"""Several requests' prefill pieces in one forward, and whether a model can be batched at all."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from inference_service.model.attention import engine_call_kwargs
from inference_service.kv_memory.kv_buffers import PreallocatedLayer


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


class BatchWorkspace:
    """The batch buffers of prefill_rows, kept from one batched prefill to the next on a CPU.

    A fresh buffer of a few hundred MB is fresh pages from the kernel, and its first write faults every 4 KiB page
    in, several times the copy into reused pages (docs/performance.md, Serving costs). Buffers up to max_bytes (keys and
    values together) are kept; a larger batch gets buffers of its own, as before. The contents never carry over:
    prefill_rows writes every column it reads (zeros, cached K/V, or the forward's new K/V). The kept buffers are
    process memory outside --kv-cache-bytes (at most max_bytes; a batch too large for them releases them and gets
    its own). On a GPU torch's caching allocator already reuses memory: for_device gives None there."""

    DEFAULT_MAX_BYTES = 512 << 20

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._storage: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> BatchWorkspace | None:
        return cls() if torch.device(device).type == "cpu" else None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of `shape`, uninitialised."""
        numel = 1
        for size in shape:
            numel *= size
        held = self._storage
        if held is not None and held[0].numel() >= numel and held[0].dtype == dtype \
                and held[0].device == torch.device(device):
            return held[0][:numel].view(shape), held[1][:numel].view(shape)
        self._storage = held = None  # released before anything new is allocated: never two sets at once
        if 2 * numel * dtype.itemsize > self.max_bytes:
            return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
        held = self._storage = (torch.empty(numel, dtype=dtype, device=device),
                                torch.empty(numel, dtype=dtype, device=device))
        return held[0][:numel].view(shape), held[1][:numel].view(shape)


@dataclass(slots=True)
class PrefillRow:
    """One request's prefill piece: its buffers [layers, kv_heads, capacity, head_dim] hold `start` cached
    tokens; token_ids run at positions start, start + 1, ..."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int
    token_ids: Sequence[int]


@torch.inference_mode()
def prefill_rows(model, rows: Sequence[PrefillRow], pad_token_id: int = 0,
                 workspace: BatchWorkspace | None = None) -> torch.Tensor:
    """Runs every row's tokens after its own cached ones in ONE forward; returns each row's last-token logits
    [rows, vocab] (float32) and writes the new K/V into each row's buffers after its cached tokens.

    Layout of row i in the temporary batch (C = longest cached run, S = longest piece):

        [unread: mask 0][cached_i: mask 1, ends at C][pads: mask 0][tokens_i: mask 1, ends at C + S]

    so every row's last token sits in the last column; the mask keeps pads and other rows out of it. The batch
    buffers come from `workspace` when one is given.
    """
    assert rows and all(row.token_ids for row in rows), "prefill_rows needs rows with tokens to run"
    first = rows[0].keys
    num_layers, num_kv_heads, _, head_dim = first.shape
    num_rows = len(rows)
    longest_cached = max(row.start for row in rows)
    longest = max(len(row.token_ids) for row in rows)
    width = longest_cached + longest
    shape = (num_layers, num_rows, num_kv_heads, width, head_dim)
    if workspace is None:
        keys = torch.empty(shape, dtype=first.dtype, device=first.device)
        values = torch.empty(shape, dtype=first.dtype, device=first.device)
    else:
        keys, values = workspace.take(shape, first.dtype, first.device)
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
