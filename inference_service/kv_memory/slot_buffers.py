"""Every request's K/V in fixed-capacity slots: the memory a decode step runs over (no relayout, no concatenation).

Layout: keys, values [layers, slots, kv_heads, capacity, head_dim]. A request prefills into its slot's view
[layers, kv_heads, capacity, head_dim] (what kv_buffers.build_cache wraps) and decodes from the same place:
nothing moves when it joins the running batch. Row s writes its token t at column t; a decode step over the slots
from the lowest to the highest decoding one attends to columns [0, L) where L is one past the furthest row, each
row masked to its own columns. The last column is scratch: slots in that range that do not decode this step
(free, prefilling, or draining a write-back) write there and are never read. The step itself is
model/step_runner.py's.
"""
from __future__ import annotations

import torch

from inference_service.kv_memory.kv_buffers import KVGeometry


class SlotBuffers:
    """The K/V memory of every slot; the columns a decoding row may read are kept finite (masked columns still
    enter the products, and 0 x NaN is NaN)."""

    def __init__(self, geometry: KVGeometry, num_slots: int, capacity: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (geometry.num_layers, num_slots, geometry.num_kv_heads, capacity + 1, geometry.head_dim)
        # Uninitialized: on a CPU, pages are committed only as columns are written.
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.capacity, self.device = capacity, device
        self.finite_until = [0] * num_slots  # columns [0, n) of each slot hold finite values

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

    def keep_finite(self, slots: list[int], length: int) -> None:
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
