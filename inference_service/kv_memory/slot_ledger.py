"""Bookkeeping of K/V memory, in bytes and slots: who holds what (pure: no tensors)."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True)
class SlotLedger:
    """Reserves K/V at admission: a request's rows take one slot each and prompt + max_new_tokens per row in bytes.

    Reserving the whole request up front means the budget can never run out mid-decode (nothing is preempted
    or recomputed); a request that does not fit waits. Slots are handed out lowest first, so the running
    rows stay packed together (a decode step runs over the slots from the lowest to the highest in use).
    A row's bytes come back when it ends (`release_row`); its slot only once the write-back reading it is done
    (`free`). How many requests run at once is the scheduler's limit, not the ledger's.
    """

    num_slots: int
    budget_bytes: int
    bytes_per_token: int
    _free: list[int] = field(default_factory=list)
    _bytes_by_slot: dict[int, int] = field(default_factory=dict)
    bytes_in_use: int = 0

    def __post_init__(self) -> None:
        assert self.num_slots > 0, f"num_slots must be positive, got {self.num_slots}"
        assert self.budget_bytes > 0 and self.bytes_per_token > 0, "the budget and bytes per token must be positive"
        self._free = list(range(self.num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_rows(self) -> int:
        return len(self._bytes_by_slot)

    def bytes_for(self, num_tokens: int, num_rows: int = 1) -> int:
        return num_tokens * num_rows * self.bytes_per_token

    def fits_at_all(self, num_tokens: int, num_rows: int = 1) -> bool:
        """Whether the request could ever be admitted (alone, with every slot free)."""
        return num_rows <= self.num_slots and self.bytes_for(num_tokens, num_rows) <= self.budget_bytes

    def can_admit(self, num_tokens: int, num_rows: int = 1) -> bool:
        return (num_rows <= len(self._free)
                and self.bytes_in_use + self.bytes_for(num_tokens, num_rows) <= self.budget_bytes)

    def admit(self, num_tokens: int, num_rows: int = 1) -> list[int]:
        """Reserves num_rows slots of num_tokens tokens each; returns the slots, lowest first."""
        assert self.can_admit(num_tokens, num_rows), "admit only what can_admit accepts"
        slots = [heapq.heappop(self._free) for _ in range(num_rows)]
        for slot in slots:
            self._bytes_by_slot[slot] = self.bytes_for(num_tokens)
        self.bytes_in_use += self.bytes_for(num_tokens, num_rows)
        return slots

    def release_row(self, slot: int) -> None:
        """The row in `slot` ended: its bytes are free; the slot is not, yet."""
        assert slot in self._bytes_by_slot, f"slot {slot} holds no row"
        self.bytes_in_use -= self._bytes_by_slot.pop(slot)

    def free(self, slot: int) -> None:
        """Nothing reads the slot any more: it can be handed out again."""
        assert slot not in self._bytes_by_slot and slot not in self._free, f"slot {slot} is in use or free already"
        heapq.heappush(self._free, slot)

    def release(self, slot: int) -> None:
        """release_row and free at once (a row whose slot nothing else reads)."""
        self.release_row(slot)
        self.free(slot)


@dataclass(slots=True, frozen=True)
class SlotLayout:
    """How the K/V slots are laid out: num_slots slots of `capacity` tokens each (plus one scratch column)."""

    num_slots: int
    capacity: int
    by_budget: bool  # sized so that the slots' memory stays within the budget

    def __post_init__(self) -> None:
        assert self.num_slots > 0 and self.capacity > 0, f"a layout needs slots and room: {self}"

    def memory_bytes(self, bytes_per_token: int) -> int:
        """What the slots take when every page is committed (the scratch column included)."""
        return self.num_slots * (self.capacity + 1) * bytes_per_token


def plan_slots(wanted_slots: int, longest_request: int, budget_bytes: int, bytes_per_token: int,
               by_budget: bool) -> SlotLayout:
    """The slot layout for a budget.

    by_budget False (a CPU: pages are committed only when written, and admission keeps what is written within the
    budget): every wanted slot holds the longest request. by_budget True (a GPU: memory is committed at
    allocation): as many slots of the longest request as the budget holds, at most wanted_slots; when not even
    one fits, one slot of what the budget holds (requests longer than that are refused, with the reason).
    longest_request: prompt and generated tokens of the longest request the service takes.
    """
    if not by_budget:
        return SlotLayout(wanted_slots, longest_request, False)
    per_slot = (longest_request + 1) * bytes_per_token
    num_slots = min(wanted_slots, budget_bytes // per_slot)
    if num_slots >= 1:
        return SlotLayout(num_slots, longest_request, True)
    return SlotLayout(1, max(1, budget_bytes // bytes_per_token - 1), True)
