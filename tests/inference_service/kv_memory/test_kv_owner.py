"""The K/V owner: a slot is freed once nothing holds it, releases from other threads applied by the step loop."""
from __future__ import annotations

import threading

import torch

from inference_service.kv_memory.kv_owner import KvOwner, bytes_per_token
from inference_service.kv_memory.slot_ledger import SlotLedger
from inference_service.kv_memory.kv_buffers import KVGeometry

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, max_context=32)


def make_owner(num_slots: int = 3) -> KvOwner:
    ledger = SlotLedger(num_slots, 10_000, bytes_per_token(GEOMETRY, torch.float32))
    return KvOwner(ledger, GEOMETRY, 33, torch.device("cpu"), torch.float32)


def test_bytes_per_token_count_keys_and_values_of_every_layer():
    assert bytes_per_token(GEOMETRY, torch.float32) == 2 * 2 * 2 * 4 * 4
    assert bytes_per_token(GEOMETRY, torch.bfloat16) == 2 * 2 * 2 * 4 * 2


def test_a_slot_is_freed_when_its_row_and_its_write_back_are_both_done():
    owner = make_owner()
    (slot,) = owner.ledger.admit(10)
    owner.hold(slot)  # its row
    owner.hold(slot)  # the write-back reading its K/V
    owner.end_row(slot)  # the row ended: its bytes are free at once
    owner.collect()
    assert owner.ledger.bytes_in_use == 0
    assert owner.ledger.num_free_slots == 2, "the write-back still reads the slot"
    done = threading.Thread(target=owner.let_go, args=(slot,))  # the write-back thread lets go
    done.start()
    done.join()
    assert owner.ledger.num_free_slots == 2, "freed only by the step loop's collect"
    owner.collect()
    assert owner.ledger.num_free_slots == 3


def test_views_write_into_the_slot():
    owner = make_owner()
    owner.buffers.keys.zero_()  # the slots are allocated uninitialised: what memory held before could read 7.0
    keys, values = owner.views(1)
    assert keys.shape == (2, 2, 33, 4)
    keys[:, :, 5].fill_(7.0)
    assert bool((owner.buffers.keys[:, 1, :, 5] == 7.0).all()) and not bool((owner.buffers.keys[:, 0, :, 5] == 7.0).all())
