"""L0: whole chunks' K/V by prefix key within its bytes, evicted leaf first by decayed frequency, copies kept."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_service.kv_memory.l0_tier import L0Tier
from inference_service.store.protocol import DeleteEpoch

CHUNK_BYTES = 2 * 2 * 3 * 4 * 5 * 4  # keys and values [2 layers, 3 heads, 4 tokens, 5 dims] in float32


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every add and take happens one second after the one before
        return self.now


def chunk(fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((2, 3, 4, 5), fill), torch.full((2, 3, 4, 5), -fill)


def add_chain(l0: L0Tier, *names: bytes) -> list[bool]:
    parent = None  # the prompt's first chunk
    kept = []
    for name in names:
        kept.append(l0.add(name, *chunk(1.0), parent=parent))
        parent = name
    return kept


def test_a_chunk_comes_back_as_it_was_added_even_when_its_source_changes():
    l0 = L0Tier(10 * CHUNK_BYTES)
    keys, values = chunk(1.0)
    l0.add(b"a", keys, values)
    keys.fill_(9.0)  # the slot is reused: L0 kept its own copy
    taken = l0.take(b"a")
    assert torch.equal(taken[0], torch.full((2, 3, 4, 5), 1.0)) and torch.equal(taken[1], torch.full((2, 3, 4, 5), -1.0))
    assert l0.take(b"b") is None
    assert l0.snapshot() == {"l0_chunks_hit": 1, "l0_bytes_placed": CHUNK_BYTES, "l0_bytes_held": CHUNK_BYTES,
                              "l0_chunks_held": 1, "l0_chunks_evicted": 0, "l0_chunks_rejected": 0,
                              "l0_chunks_alone": 0}


def test_the_least_recently_used_leaf_goes_first_when_room_is_needed():
    l0 = L0Tier(3 * CHUNK_BYTES, clock=Clock())
    for name in (b"a", b"b", b"c"):  # three one-chunk prompts
        l0.add(name, *chunk(1.0))
    l0.take(b"a")  # a is hit: b is now the least worth keeping
    l0.add(b"d", *chunk(2.0))
    assert [name in l0 for name in (b"a", b"b", b"c", b"d")] == [True, False, True, True]
    assert l0.bytes_held == 3 * CHUNK_BYTES and l0.snapshot()["l0_chunks_evicted"] == 1


def test_a_prompt_longer_than_l0_keeps_its_head_and_is_served_from_its_first_chunk():
    l0 = L0Tier(3 * CHUNK_BYTES, clock=Clock())
    assert add_chain(l0, b"p0", b"p1", b"p2", b"p3", b"p4") == [True, True, True, False, False]
    assert len(l0.take_run([b"p0", b"p1", b"p2", b"p3", b"p4"], [4] * 5)) == 3  # its first three chunks
    # Another prompt evicts the first prompt's chunks from its last one back, never its head before its tail.
    assert add_chain(l0, b"q0", b"q1") == [True, True]
    assert [name in l0 for name in (b"p0", b"p1", b"p2", b"q0", b"q1")] == [True, False, False, True, True]
    assert l0.snapshot()["l0_chunks_rejected"] == 2 and l0.snapshot()["l0_chunks_evicted"] == 2


def test_take_run_stops_at_the_first_chunk_missing_or_of_another_length():
    l0 = L0Tier(10 * CHUNK_BYTES)
    add_chain(l0, b"a", b"b", b"c")
    assert len(l0.take_run([b"a", b"b", b"c"], [4, 4, 3])) == 2  # c holds 4 tokens, the prompt's last chunk 3
    assert len(l0.take_run([b"a", b"x", b"c"], [4, 4, 4])) == 1
    assert l0.snapshot()["l0_chunks_hit"] == 3 and l0.snapshot()["l0_bytes_placed"] == 3 * CHUNK_BYTES


def test_a_chunk_larger_than_the_tier_is_not_kept_and_a_second_add_keeps_the_first_copy():
    l0 = L0Tier(CHUNK_BYTES - 1)
    assert not l0.add(b"a", *chunk(1.0))
    assert len(l0) == 0 and l0.bytes_held == 0
    l0 = L0Tier(2 * CHUNK_BYTES)
    l0.add(b"a", *chunk(1.0))
    l0.add(b"a", *chunk(5.0))
    assert l0.take(b"a")[0][0, 0, 0, 0] == 1.0 and l0.bytes_held == CHUNK_BYTES


def test_a_pending_chunk_that_is_not_kept_is_not_pending():
    l0 = L0Tier(CHUNK_BYTES, clock=Clock())
    add_chain(l0, b"a")
    assert not l0.add(b"b", *chunk(1.0), pending=True, parent=b"a")  # only its own parent could make room
    assert not l0.is_pending(b"b") and b"a" in l0


EPOCH = DeleteEpoch("start-1", 0, asked=1)


def test_a_chunk_the_daemon_confirmed_is_served_alone_until_a_delete_moves_the_epoch_on():
    l0 = L0Tier(10 * CHUNK_BYTES)
    add_chain(l0, b"a", b"b", b"c")
    assert l0.extend_run([b"a", b"b", b"c"], 0, EPOCH) == 0  # held, never confirmed: the daemon decides
    assert l0.confirm(EPOCH, [b"a", b"b", b"x"])  # x: not held, nothing to confirm
    # The daemon evicted a and b for its budget (its run is 0 now), and no Delete came: L0 answers for them.
    assert l0.extend_run([b"a", b"b", b"c"], 0, EPOCH) == 2
    assert l0.snapshot()["l0_chunks_alone"] == 2
    moved = DeleteEpoch("start-1", 1, asked=2)  # a Delete at the daemon (of anything: L0 does not know what)
    assert l0.confirm(moved, [b"a"])  # a later Lookup still found a
    assert l0.extend_run([b"a", b"b", b"c"], 0, moved) == 1  # b was confirmed before the Delete: the daemon decides
    assert not l0.confirm(EPOCH, [b"b"])  # an answer from before the Delete, read late: it confirms nothing ...
    assert l0.extend_run([b"a", b"b"], 0, EPOCH) == 0  # ... and runs at it are not extended
    assert l0.snapshot()["l0_chunks_alone"] == 3


def test_another_daemon_start_voids_every_confirmation_and_a_dropped_chunk_forgets_its_own():
    l0 = L0Tier(2 * CHUNK_BYTES, clock=Clock())
    add_chain(l0, b"a", b"b")
    l0.confirm(EPOCH, [b"a", b"b"])
    restarted = DeleteEpoch("start-2", 0, asked=5)
    assert l0.confirm(restarted, [])
    assert not l0.serves_alone(b"a", restarted) and not l0.serves_alone(b"a", EPOCH)
    # A late reply from before the restart (asked before the restarted start's answer, read after it): refused
    assert not l0.confirm(DeleteEpoch("start-1", 5, asked=4), [b"a"])
    assert l0.confirm(DeleteEpoch("start-2", 0, asked=6), [])  # ... and the current start stays current
    l0.confirm(restarted, [b"a", b"b"])
    add_chain(l0, b"c")  # evicts b (the leaf)
    assert b"b" not in l0 and not l0.serves_alone(b"b", restarted) and l0.serves_alone(b"a", restarted)
    assert not l0.serves_alone(b"a", None)  # a store that keeps no epoch: the daemon alone decides


def test_answers_from_two_starts_read_out_of_order_leave_l0_at_the_start_asked_last():
    # Around a restart, two requests' Lookups (asked 7 and 8) are answered by the old and the new start and read
    # in the other order: the old start's answer must not take L0 back to it for good.
    l0 = L0Tier(2 * CHUNK_BYTES, clock=Clock())
    add_chain(l0, b"a")
    old, new = DeleteEpoch("start-1", 3, asked=7), DeleteEpoch("start-2", 0, asked=8)
    assert l0.confirm(new, [b"a"]) and not l0.confirm(old, [b"a"])
    assert l0.extend_run([b"a"], 0, new) == 1 and l0.extend_run([b"a"], 0, old) == 0
    assert l0.confirm(DeleteEpoch("start-2", 0, asked=9), [])  # later answers of the new start stay current
    # Starts alternating (two daemons behind one address): each answer asked later moves L0, voiding the other's.
    assert l0.confirm(DeleteEpoch("start-1", 3, asked=10), [])
    assert l0.extend_run([b"a"], 0, DeleteEpoch("start-1", 3, asked=10)) == 0


def test_a_written_back_chunk_is_not_served_alone_after_a_delete_while_its_store_is_in_flight():
    l0 = L0Tier(10 * CHUNK_BYTES)
    l0.confirm(EPOCH, [])
    l0.add(b"w", *chunk(1.0), pending=True)  # its write-back started; the Store has not reached the daemon
    assert l0.extend_run([b"w"], 0, EPOCH) == 1
    moved = DeleteEpoch("start-1", 1, asked=2)  # a Delete (of w, perhaps) returned before the Store arrived
    assert l0.confirm(moved, [])
    assert l0.is_pending(b"w") and l0.extend_run([b"w"], 0, moved) == 0  # the daemon decides again
    assert l0.serves_alone(b"w", None)  # a store that keeps no epoch: in flight, as before epochs


def test_a_written_back_chunk_is_served_alone_at_the_epoch_it_was_added_at_and_a_fetched_one_once_confirmed():
    l0 = L0Tier(10 * CHUNK_BYTES)
    l0.confirm(EPOCH, [])
    l0.add(b"w", *chunk(1.0), pending=True, epoch=EPOCH)  # a write-back: computed here, stored at the daemon after it
    l0.add(b"f", *chunk(1.0))  # fetched: the Lookup that found it may predate a Delete L0 has not heard of
    l0.settle([b"w"])
    assert l0.serves_alone(b"w", EPOCH) and not l0.serves_alone(b"f", EPOCH)
    l0.confirm(EPOCH, [b"f"])
    assert l0.serves_alone(b"f", EPOCH)


def test_a_write_back_computed_before_the_current_epoch_is_not_served_alone_at_it():
    """Its Lookup answered at EPOCH; another request's Lookup has since brought L0 the next epoch (a Delete, of this
    chunk perhaps): the daemon leaves the chunk out of the Store, so L0 must not count it as confirmed at the new one."""
    l0 = L0Tier(10 * CHUNK_BYTES)
    moved = DeleteEpoch("start-1", 1, asked=2)
    l0.confirm(moved, [])
    l0.add(b"old", *chunk(1.0), pending=True, epoch=EPOCH)
    l0.add(b"new", *chunk(2.0), pending=True, epoch=moved)
    l0.add(b"unknown", *chunk(3.0), pending=True)  # no Lookup answered it: its Store carries no epoch, is stored
    l0.settle([b"old", b"new", b"unknown"])
    assert [l0.serves_alone(key, moved) for key in (b"old", b"new", b"unknown")] == [False, True, True]

MEASURE_RESIDENT = """
import os, sys, torch
from inference_service.kv_memory.l0_tier import L0Tier

def resident_bytes():  # anonymous memory only: library code paged in by the first copy is not L0's
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("RssAnon:"))

budget = 64 << 20
l0 = L0Tier(budget, clock=iter(range(1, 1 << 20)).__next__)
source = torch.ones(2, 8, 128, 128)  # 1 MiB of keys and 1 MiB of values a chunk, written into fresh copies
source.clone()  # the first copy sets up what every later one reuses (the copy kernel's state, a thread pool)
before = resident_bytes()
for index in range(256):  # 512 MiB offered, one prompt after another (each its own first chunk)
    l0.add(index.to_bytes(2, "big"), source, source)
print(resident_bytes() - before, l0.bytes_held, len(l0))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_the_memory_l0_takes_is_its_budget_however_much_is_offered():
    # In a process of its own: in the test process, what earlier tests left to the allocator (or threads they left
    # running) moved the resident size, so the verdict depended on the order tests ran in.
    done = subprocess.run([sys.executable, "-c", MEASURE_RESIDENT], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    grown, bytes_held, num_chunks = map(int, done.stdout.split())
    budget = 64 << 20
    assert bytes_held <= budget and num_chunks == 32
    assert grown < budget + (32 << 20), f"RSS grew {grown >> 20} MiB for an L0 of {budget >> 20} MiB"
