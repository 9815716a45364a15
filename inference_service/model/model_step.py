"""The model's own forward as a decode step over slots: what runs where the lean step cannot (and its reference)."""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from inference_service.model.attention import engine_call_kwargs


class SlotLayer(DynamicLayer):
    """One layer of a batched decode: row s writes its new K/V at its own column, attention sees [0, L)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device
        self._all_keys, self._all_values = keys, values  # [rows, kv_heads, capacity, head_dim]
        self._rows = torch.arange(keys.shape[0], device=keys.device)
        self._columns = self._rows
        self._length = 1

    def prepare(self, columns: torch.Tensor, length: int) -> None:
        """columns: [rows] where each row's token is written; length: columns attention reads ([0, length))."""
        self._columns, self._length = columns, length
        self.keys = self._all_keys[:, :, : length - 1]  # the past, as get_seq_length and the masks read it
        self.values = self._all_values[:, :, : length - 1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [rows, kv_heads, 1, head_dim]
        self._all_keys[self._rows, :, self._columns] = key_states[:, :, 0]
        self._all_values[self._rows, :, self._columns] = value_states[:, :, 0]
        return self._all_keys[:, :, : self._length], self._all_values[:, :, : self._length]


class ModelStep:
    """LeanStep's call, run by the model's forward over a cache whose layers are the slots' views."""

    def __init__(self, model) -> None:
        self.model = model
        # one cache per view of the slots (the same rows of the same buffers): made once, reused every step
        self._caches: dict[tuple, tuple[DynamicCache, list[SlotLayer]]] = {}

    @torch.inference_mode()
    def __call__(self, keys: torch.Tensor, values: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                 columns: torch.Tensor, length: int, mask: torch.Tensor) -> torch.Tensor:
        """As LeanStep.__call__: logits [rows, vocab] (float32), each row's K/V written at its column."""
        cache, layers = self._cache(keys, values)
        for layer in layers:
            layer.prepare(columns, length)
        output = self.model(input_ids=token_ids, attention_mask=mask, position_ids=positions.view(-1, 1),
                            past_key_values=cache, use_cache=True, **engine_call_kwargs())
        return output.logits[:, -1].float()

    def _cache(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[DynamicCache, list[SlotLayer]]:
        view = (keys.data_ptr(), values.data_ptr(), tuple(keys.shape), keys.stride())
        if view not in self._caches:
            cache = DynamicCache(config=self.model.config)
            layers = [SlotLayer(keys[index], values[index]) for index in range(len(cache.layers))]
            cache.layers[:] = layers
            self._caches[view] = (cache, layers)
        return self._caches[view]
