"""Device side of continuous batching: the K/V of every running request in one left-padded batch of slots.

Layout of slot s in the buffers (`length` columns used, `capacity` allocated):

    [columns no longer read: mask 0][row s's tokens: mask 1][its generated tokens: mask 1]

A row joins by copying its prefilled K/V so its last token ends at column `length`; every decode step
appends one column to all slots. A finished row's slot stays in the batch (decoding a pad token that no
live row reads) until a new row takes it over or the batch is compacted. Pads never leak: a row's mask
is 0 on every column that is not its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from inference_service.model.batch_forward import batch_cache
from inference_service.model.kv_buffers import KVGeometry


@dataclass(slots=True)
class RunningBatch:
    config: object  # the model's config (cache layers)
    geometry: KVGeometry
    device: torch.device
    dtype: torch.dtype
    # keys, values: [layers, slots, kv_heads, capacity, head_dim]; a live row's columns are all finite.
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None  # [slots, length] int64
    cache: DynamicCache | None = None
    length: int = 0
    starts: list[int] = field(default_factory=list)  # first column of each slot's row
    live: list[bool] = field(default_factory=list)

    @property
    def num_slots(self) -> int:
        return len(self.live)

    @property
    def num_live(self) -> int:
        return sum(self.live)

    @torch.inference_mode()
    def add(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
        """Places prefilled rows (each keys, values: [layers, kv_heads, n, head_dim]); returns their slots.

        The rows that join in one step move the batch at most once (more slots, a longer common length).
        An empty batch starts over in the buffers it has when they hold the rows: no new allocation.
        """
        longest = max(row_keys.shape[2] for row_keys, _ in rows)
        if self.num_live == 0:
            if (self.keys is None or self.keys.shape[1] < len(rows) or self.keys.shape[3] < longest + 1):
                self._allocate(max(len(rows), self.num_slots), max(2 * longest, 64), longest)
            else:
                self._restart(longest)
        else:
            num_slots = self.num_slots
            if self.num_live + len(rows) > num_slots:
                num_slots = max(2 * num_slots, self.num_live + len(rows))
            if longest > self.length or num_slots > self.num_slots:
                self._relayout(num_slots, shift=max(0, longest - self.length))
        free = [slot for slot, live in enumerate(self.live) if not live]
        for slot, (row_keys, row_values) in zip(free, rows):
            begin = self.length - row_keys.shape[2]
            # Columns before the row are masked, but still enter the product: they must be finite.
            self.keys[:, slot, :, :begin].zero_()
            self.values[:, slot, :, :begin].zero_()
            self.keys[:, slot, :, begin : self.length].copy_(row_keys)
            self.values[:, slot, :, begin : self.length].copy_(row_values)
            self.attention_mask[slot].zero_()
            self.attention_mask[slot, begin:] = 1
            self.starts[slot], self.live[slot] = begin, True
        return free[: len(rows)]

    def release(self, slot: int) -> None:
        """The row in `slot` finished; its slot is reused by a later row or dropped at compaction."""
        assert self.live[slot], f"slot {slot} is not running"
        self.live[slot] = False

    @torch.inference_mode()
    def decode(self, model, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token per slot (token_ids[s] at positions[s]; anything for a free slot); logits [slots, vocab]."""
        if self.length + 1 > self.keys.shape[3]:
            self._relayout(self.num_slots, shift=0, capacity=2 * (self.length + 1))
        num_slots = self.num_slots
        ones = torch.ones((num_slots, 1), dtype=torch.long, device=self.device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)  # a free slot reads its own token
        output = model(
            input_ids=torch.tensor(token_ids, device=self.device).view(num_slots, 1),
            attention_mask=self.attention_mask,
            position_ids=torch.tensor(positions, device=self.device).view(num_slots, 1),
            past_key_values=self.cache, use_cache=True,
        )
        self.length += 1
        return output.logits[:, -1].float()

    @torch.inference_mode()
    def maybe_compact(self) -> dict[int, int]:
        """Drops free slots and columns no live row reads when they are most of the batch.

        Returns {old slot: new slot} for the live rows (empty when nothing moved).
        """
        if self.keys is None:
            return {}
        live_slots = [slot for slot, live in enumerate(self.live) if live]
        if not live_slots:  # the buffers stay for the next rows (an allocation of this size is slow to fault in)
            return {}
        unread = min(self.starts[slot] for slot in live_slots)
        if len(live_slots) * 2 > self.num_slots and unread * 2 < self.length:
            return {}
        keep = torch.tensor(live_slots, device=self.device)
        keys = self.keys.index_select(1, keep)[:, :, :, unread : self.length]
        values = self.values.index_select(1, keep)[:, :, :, unread : self.length]
        mask = self.attention_mask.index_select(0, keep)[:, unread:]
        length, old_starts = self.length - unread, self.starts
        self._allocate(len(live_slots), 2 * length + 16, length)
        self.keys[:, :, :, :length].copy_(keys)
        self.values[:, :, :, :length].copy_(values)
        self.attention_mask.copy_(mask)
        self.starts = [old_starts[slot] - unread for slot in live_slots]
        self.live = [True] * len(live_slots)
        return {old: new for new, old in enumerate(live_slots)}

    def _allocate(self, num_slots: int, capacity: int, length: int) -> None:
        """Uninitialized buffers: a slot's columns are zeroed or written before a live row reads them (a free
        slot decodes whatever it holds; its output is never read and rows never mix)."""
        shape = (self.geometry.num_layers, num_slots, self.geometry.num_kv_heads, capacity, self.geometry.head_dim)
        self.keys = torch.empty(shape, device=self.device, dtype=self.dtype)
        self.values = torch.empty(shape, device=self.device, dtype=self.dtype)
        self._restart(length)

    def _restart(self, length: int) -> None:
        """No row in the buffers; the next ones end at column `length`."""
        num_slots = self.keys.shape[1]
        self.attention_mask = torch.zeros((num_slots, length), dtype=torch.long, device=self.device)
        self.cache = batch_cache(self.config, self.keys, self.values, length)
        self.length = length
        self.starts, self.live = [length] * num_slots, [False] * num_slots

    def _relayout(self, num_slots: int, shift: int, capacity: int | None = None) -> None:
        """New buffers with num_slots slots, every column moved right by `shift` (new columns unread)."""
        old_keys, old_values, old_mask = self.keys, self.values, self.attention_mask
        old_length, old_starts, old_live = self.length, self.starts, self.live
        length = old_length + shift
        self._allocate(num_slots, max(capacity or 0, old_keys.shape[3] + shift, length + 1), length)
        count = old_keys.shape[1]
        self.keys[:, :count, :, :shift].zero_()
        self.values[:, :count, :, :shift].zero_()
        self.keys[:, :count, :, shift:length].copy_(old_keys[:, :, :, :old_length])
        self.values[:, :count, :, shift:length].copy_(old_values[:, :, :, :old_length])
        self.attention_mask[:count, shift:] = old_mask
        self.starts[:count] = [start + shift for start in old_starts]
        self.live[:count] = old_live
