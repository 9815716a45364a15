"""The one owner of K/V memory: slots reserved in bytes (SlotLedger), their buffers (SlotBuffers), and who holds them."""
from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING

import torch

from inference_service.kv_memory.kv_buffers import KVGeometry
from inference_service.kv_memory.slot_buffers import SlotBuffers


if TYPE_CHECKING:  # annotations only: the core makes the ledger the scheduler and this owner share
    from inference_service.kv_memory.slot_ledger import SlotLedger


def bytes_per_token(geometry: KVGeometry, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    return 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * torch.tensor([], dtype=dtype).element_size()


class KvOwner:
    """Hands slots out through the ledger and frees a slot once nothing holds it: its row has ended (`end_row`,
    which also gives the row's bytes back at once) and the write-back that reads its K/V (on another thread)
    has encoded them. Releases from other threads are queued and applied by the step loop (`collect`), which
    alone touches the ledger."""

    def __init__(self, ledger: SlotLedger, geometry: KVGeometry, capacity: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.ledger = ledger
        self.buffers = SlotBuffers(geometry, ledger.num_slots, capacity, device, dtype)
        self._holds: Counter[int] = Counter()
        self._released: list[int] = []
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Tokens one slot holds (prompt and generated)."""
        return self.buffers.capacity

    def views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffers.views(slot)

    def hold(self, slot: int) -> None:
        """One more holder of the slot (a row when it is admitted; a write-back reading its K/V)."""
        with self._lock:
            self._holds[slot] += 1

    def let_go(self, slot: int) -> None:
        """A holder is done with the slot; callable from any thread (freed at the next `collect`)."""
        with self._lock:
            self._holds[slot] -= 1
            if self._holds[slot] == 0:
                del self._holds[slot]
                self._released.append(slot)

    def end_row(self, slot: int) -> None:
        """The row in `slot` ended (on the step loop's thread): its bytes are free now, the slot once unheld."""
        self.ledger.release_row(slot)
        self.let_go(slot)

    def collect(self) -> None:
        """Frees the slots nothing holds any more (on the step loop's thread)."""
        with self._lock:
            released, self._released = self._released, []
        for slot in released:
            self.ledger.free(slot)

    def stats(self) -> dict:
        return {"kv_bytes_in_use": self.ledger.bytes_in_use, "kv_budget_bytes": self.ledger.budget_bytes,
                "kv_slots_free": self.ledger.num_free_slots}
