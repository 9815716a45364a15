"""Every request's K/V in fixed-capacity slots, and one batched decode step over them (no relayout, no concatenation).

Layout: keys, values [layers, slots, kv_heads, capacity, head_dim]. A request prefills into its slot's view
[layers, kv_heads, capacity, head_dim] (what kv_buffers.build_cache wraps) and decodes from the same place:
nothing moves when it joins the running batch. Row s writes its token t at column t; a decode step over the slots
from the lowest to the highest decoding one attends to columns [0, L) where L is one past the furthest row, each
row masked to its own columns. The last column is scratch: slots in that range that do not decode this step
(free, prefilling, or draining a write-back) write there and are never read.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from inference_service.model.attention import engine_call_kwargs
from inference_service.model.graph_step import CaptureFailed
from inference_service.model.decode_step import LeanStep
from inference_service.model.kv_buffers import KVGeometry


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


class SlotBuffers:
    """The K/V memory of every slot; the columns a decoding row may read are kept finite (masked columns still
    enter the products, and 0 x NaN is NaN)."""

    def __init__(self, config, geometry: KVGeometry, num_slots: int, capacity: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (geometry.num_layers, num_slots, geometry.num_kv_heads, capacity + 1, geometry.head_dim)
        # Uninitialized: on a CPU, pages are committed only as columns are written.
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.config, self.capacity, self.device = config, capacity, device
        self.finite_until = [0] * num_slots  # columns [0, n) of each slot hold finite values
        self.step: LeanStep | None = None  # decode through the model's own forward when None (step_choice)
        self.graphs = None  # model.graph_step.GraphSteps: the step replayed from CUDA graphs where they were captured
        self._caches: dict[tuple[int, int], tuple[DynamicCache, list[SlotLayer]]] = {}

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    def views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's keys, values [layers, kv_heads, capacity, head_dim] (views: writes land in the slot)."""
        return self.keys[:, slot, :, : self.capacity], self.values[:, slot, :, : self.capacity]

    def written(self, slot: int, num_tokens: int) -> None:
        """Columns [0, num_tokens) of the slot were written (a prefill, a copy)."""
        self.finite_until[slot] = num_tokens

    @torch.inference_mode()
    def copy_prefix(self, source: int, target: int, num_tokens: int) -> None:
        """The first num_tokens columns of `source` into `target` (n completions of one prompt, a shared prefix)."""
        self.keys[:, target, :, :num_tokens].copy_(self.keys[:, source, :, :num_tokens])
        self.values[:, target, :, :num_tokens].copy_(self.values[:, source, :, :num_tokens])
        self.finite_until[target] = num_tokens

    @torch.inference_mode()
    def decode(self, model, rows: dict[int, tuple[int, int]]) -> torch.Tensor:
        """One token for each slot in rows ({slot: (token id, position)}); returns logits [len(rows), vocab]
        (float32) in the order of `rows`."""
        first, last = min(rows), max(rows)
        num_rows = last - first + 1  # a view of slots first..last: no copy
        length = max(position for _, position in rows.values()) + 1
        token_ids = [0] * num_rows
        positions = [0] * num_rows
        columns = [self.capacity] * num_rows  # the scratch column
        for slot, (token_id, position) in rows.items():
            token_ids[slot - first], positions[slot - first], columns[slot - first] = token_id, position, position
        if self.graphs is not None and self.graphs.can_run(last, length):
            self._keep_finite(list(rows), self.graphs.shape_for(last, length)[1])
            try:
                return self.graphs.run(rows, length)
            except CaptureFailed:  # logged; this step and the next run eagerly (nothing was written)
                pass
        self._keep_finite(list(rows), length)
        column_ids = torch.arange(length, device=self.device)
        position_tensor = torch.tensor(positions, device=self.device)
        # mask: [rows, 1, 1, length], True where a row may attend: its own columns up to its position.
        mask = (column_ids[None, :] <= position_tensor[:, None])[:, None, None, :]
        token_tensor = torch.tensor(token_ids, device=self.device).view(num_rows, 1)
        column_tensor = torch.tensor(columns, device=self.device)
        if self.step is not None:
            logits = self.step(self.keys[:, first : last + 1], self.values[:, first : last + 1], token_tensor,
                               position_tensor, column_tensor, length, mask)
        else:
            logits = self._model_forward(model, first, last + 1, token_tensor, position_tensor, column_tensor,
                                         length, mask)
        order = [slot - first for slot in rows]
        if order == list(range(num_rows)):
            return logits
        return logits[torch.tensor(order, device=self.device)]

    def _model_forward(self, model, first: int, end: int, token_ids: torch.Tensor, positions: torch.Tensor,
                       columns: torch.Tensor, length: int, mask: torch.Tensor) -> torch.Tensor:
        cache, layers = self._cache(first, end)
        for layer in layers:
            layer.prepare(columns, length)
        output = model(input_ids=token_ids, attention_mask=mask, position_ids=positions.view(-1, 1),
                       past_key_values=cache, use_cache=True, **engine_call_kwargs())
        return output.logits[:, -1].float()  # [rows, vocab], row i for slot first + i

    def _keep_finite(self, slots: list[int], length: int) -> None:
        """Zeroes the columns up to `length` that decoding rows read masked but nothing has written yet."""
        by_start: dict[int, list[int]] = {}
        for slot in slots:
            if self.finite_until[slot] < length:
                by_start.setdefault(self.finite_until[slot], []).append(slot)
                self.finite_until[slot] = length
        for start, group in by_start.items():
            index = torch.tensor(group, device=self.device)
            self.keys[:, index, :, start:length] = 0
            self.values[:, index, :, start:length] = 0

    def _cache(self, first: int, end: int) -> tuple[DynamicCache, list[SlotLayer]]:
        """The cache over slots [first, end), made once per range."""
        if (first, end) not in self._caches:
            cache = DynamicCache(config=self.config)
            layers = [SlotLayer(self.keys[index, first:end], self.values[index, first:end])
                      for index in range(len(cache.layers))]
            cache.layers[:] = layers
            self._caches[first, end] = (cache, layers)
        return self._caches[first, end]
