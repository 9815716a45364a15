"""K/V bookkeeping in bytes and slots, without tensors."""
from __future__ import annotations

import pytest

from inference_service.kv_memory.slot_ledger import SlotLayout, SlotLedger, plan_slots


def test_slots_come_lowest_first_and_bytes_are_reserved_per_row():
    ledger = SlotLedger(num_slots=4, budget_bytes=1000, bytes_per_token=2)
    assert ledger.admit(100) == [0]
    assert ledger.admit(50, num_rows=2) == [1, 2]
    assert ledger.bytes_in_use == 200 + 2 * 100
    ledger.release(1)
    assert ledger.bytes_in_use == 300 and ledger.num_free_slots == 2
    assert ledger.admit(10) == [1]  # the lowest free slot again: running rows stay packed at the front
    assert ledger.num_rows == 3


def test_the_budget_and_the_slots_both_bound_admission():
    ledger = SlotLedger(num_slots=2, budget_bytes=100, bytes_per_token=1)
    assert ledger.can_admit(100) and not ledger.can_admit(101)
    assert not ledger.fits_at_all(101) and not ledger.fits_at_all(10, num_rows=3)
    ledger.admit(60)
    assert not ledger.can_admit(41) and ledger.can_admit(40)
    ledger.admit(40)
    assert not ledger.can_admit(0)  # no slot left
    with pytest.raises(AssertionError):
        ledger.admit(1)
    with pytest.raises(AssertionError, match="holds no row"):
        ledger.release(3)


def test_rows_are_bounded_by_free_slots_only():
    ledger = SlotLedger(num_slots=4, budget_bytes=10_000, bytes_per_token=1)
    assert ledger.admit(10, num_rows=3) == [0, 1, 2]  # three completions of one request
    assert ledger.can_admit(10) and not ledger.can_admit(10, num_rows=2)
    assert ledger.admit(10) == [3] and not ledger.can_admit(0)
    assert not ledger.fits_at_all(10, num_rows=5) and ledger.fits_at_all(10, num_rows=4)


def test_a_rows_bytes_come_back_when_it_ends_and_its_slot_when_nothing_reads_it():
    ledger = SlotLedger(num_slots=3, budget_bytes=100, bytes_per_token=1)
    assert ledger.admit(100) == [0]
    ledger.release_row(0)  # the row ended; its write-back still reads slot 0
    assert ledger.bytes_in_use == 0 and ledger.num_rows == 0
    assert ledger.admit(100) == [1]  # a new row starts at once, in another slot
    ledger.free(0)
    with pytest.raises(AssertionError, match="in use or free already"):
        ledger.free(0)
    assert ledger.num_free_slots == 2


# -- the slot layout by budget -------------------------------------------------------------------------------

def test_on_a_cpu_every_wanted_slot_holds_the_longest_request():
    # Pages are committed only as written there: the layout is address space, admission bounds what is written.
    assert plan_slots(24, 8193, budget_bytes=1000, bytes_per_token=10, by_budget=False) == SlotLayout(24, 8193, False)


def test_by_budget_as_many_whole_slots_as_the_budget_holds():
    # An 8B-shaped model at a 32k context: 128 KiB a token, 40 GiB of budget -> 9 slots of 32769 tokens (+1 scratch).
    layout = plan_slots(24, 32769, budget_bytes=40 << 30, bytes_per_token=128 << 10, by_budget=True)
    assert layout == SlotLayout(9, 32769, True)
    assert layout.memory_bytes(128 << 10) <= 40 << 30
    # A budget with room for more slots than wanted takes the wanted ones only.
    assert plan_slots(4, 100, budget_bytes=10**9, bytes_per_token=10, by_budget=True) == SlotLayout(4, 100, True)


def test_a_128k_context_starts_under_a_40_gib_budget():
    layout = plan_slots(24, 131073, budget_bytes=40 << 30, bytes_per_token=128 << 10, by_budget=True)
    assert layout == SlotLayout(2, 131073, True) and layout.memory_bytes(128 << 10) <= 40 << 30


def test_a_budget_below_one_whole_slot_gives_one_slot_of_what_it_holds():
    layout = plan_slots(24, 8193, budget_bytes=1000, bytes_per_token=10, by_budget=True)
    assert layout == SlotLayout(1, 99, True) and layout.memory_bytes(10) <= 1000
