"""The host tier: slabs of one region, bounded; evicted leaf first with L0's chunks counted as held; placement bitwise
the daemon's 16-bit blobs; L0's evictions move there; a failed pinning falls back with one log line."""
from __future__ import annotations

import logging

import pytest
import torch

from inference_service.kv_memory.memory_plan import GIB, HOST_TIER_MAX_BYTES, plan_host_tier, wire_tiers
from inference_service.kv.blobs import decode_hit, encode_chunk_kv, place_hit_
from inference_service.kv_memory import host_tier as host_tier_module
from inference_service.kv_memory.host_tier import HostTier, _adjacent_groups, host_tier_for
from inference_service.kv_memory.l0_tier import L0Tier
from inference_service.kv_memory.tier_placement import place_from_tiers
from tests.inference_service.kv_memory.test_tier_placement import CAPACITY, DIMS, HEADS, LAYERS, chunks_of, kv, slot

CHUNK = 8
SHAPE = (LAYERS, HEADS, CHUNK, DIMS)
SLAB = 2 * LAYERS * HEADS * CHUNK * DIMS * 4  # float32


def same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return all(torch.equal(x.view(as_int[x.dtype]), y.view(as_int[y.dtype])) for x, y in zip(a, b))


def key(index: int) -> bytes:
    return bytes([index])


def parent(index: int) -> bytes | None:
    return key(index - 1) if index else None


def filled(num_slabs: int, num_chunks: int, **options) -> tuple[HostTier, list]:
    host = HostTier(num_slabs, SHAPE, torch.float32, **options)
    entries = [kv(CHUNK, seed) for seed in range(num_chunks)]
    for index, entry in enumerate(entries):
        host.add(key(index), *entry, parent=parent(index))
    return host, entries


def test_placement_from_the_host_tier_is_bitwise_the_daemons_blobs_and_leaves_the_rest_alone():
    for dtype in (torch.float32, torch.bfloat16):
        host = HostTier(4, SHAPE, dtype)
        chunks = chunks_of(8, 8, 8)
        entries = [kv(CHUNK, seed, dtype) for seed in range(3)]
        for index, entry in enumerate(entries):
            assert host.add(key(index), *entry, parent=parent(index))
        from_host, from_blobs = slot(dtype), slot(dtype)
        assert host.place_run([key(0), key(1), key(2)], 0, from_host) == 3
        for index, (chunk, (keys, values)) in enumerate(zip(chunks, entries)):
            blob = encode_chunk_kv(keys, values, chunk.start, 16)
            decoded = decode_hit(key(index), key(index), blob, chunk.start, CHUNK, (LAYERS, HEADS, chunk.end, DIMS), True)
            span = slice(chunk.start, chunk.end)
            assert place_hit_(from_blobs[0][:, :, span], from_blobs[1][:, :, span], decoded, chunk.start, None)
        assert same_bits(from_host, from_blobs)
        assert bool((from_host[0][:, :, 24:] == 7.0).all())


def test_placement_at_an_offset_and_across_slabs_that_are_not_adjacent():
    host, entries = filled(4, 4)
    # Evict chunk 3 (the leaf) for a new chunk under 2: the slab order is now 0, 1, 2, then slab 3 again for "x".
    assert host.add(b"x", *kv(CHUNK, 9), parent=key(2))
    buffers = slot()
    assert host.place_run([key(2), b"x", key(0)], 8, buffers) == 3  # slabs 2, 3 then 0: two groups, positions 8..32
    expected = [entries[2], kv(CHUNK, 9), entries[0]]
    for offset, (keys, values) in zip((8, 16, 24), expected):
        assert torch.equal(buffers[0][:, :, offset : offset + CHUNK], keys)
        assert torch.equal(buffers[1][:, :, offset : offset + CHUNK], values)
    assert host.place_run([key(3)], 0, slot()) == 0  # evicted


def test_memory_is_one_region_of_whole_slabs_and_stays_bounded():
    host, _ = filled(3, 10)  # ten chunks of one prompt into three slabs
    assert host.region.numel() == 3 * SLAB and host.max_bytes == 3 * SLAB
    assert host.bytes_held == 3 * SLAB and len(host) == 3
    # Leaf first, admitted over held ones but never by evicting its own ancestors: the head stays.
    assert [k in host for k in map(key, range(10))] == [True, True, True] + [False] * 7
    assert host.stats.chunks_rejected == 7 and host.stats.chunks_evicted == 0


def test_eviction_is_leaf_first_and_a_chunk_whose_parent_l0_holds_is_no_orphan():
    host, _ = filled(2, 2)
    # b"y" chains from b"p", which only L0 holds: alone it is an orphan, kept only in a free slab (there is none).
    assert not host.add(b"y", *kv(CHUNK, 5), parent=b"p")
    held_by_l0 = {b"p"}
    host.held_elsewhere = held_by_l0.__contains__
    assert host.add(b"y", *kv(CHUNK, 5), parent=b"p")  # now a leaf evicted for it: chunk 1, never chunk 0 first
    assert [key(0) in host, key(1) in host, b"y" in host] == [True, False, True]


def test_partial_chunks_and_other_dtypes_are_not_kept():
    host = HostTier(2, SHAPE, torch.float32)
    assert not host.add(b"tail", *kv(5, 0))
    assert not host.add(b"half", *kv(CHUNK, 0, torch.bfloat16))
    assert len(host) == 0 and host.stats.chunks_rejected == 0


def test_l0_evictions_move_to_the_host_tier_and_a_run_is_placed_from_both():
    host = HostTier(8, SHAPE, torch.float32)
    l0 = L0Tier(2 * SLAB)  # two chunks
    wire_tiers(l0, host)  # as the engine's tiers are: L0's evictions go to the host tier
    entries = [kv(CHUNK, seed) for seed in range(4)]
    for index, entry in enumerate(entries[:2]):
        l0.add(key(index), *entry, parent=parent(index))
    l0.add(b"other", *kv(CHUNK, 7))  # evicts chunk 1 (the leaf) from L0 into the host tier
    assert key(1) in host and key(1) not in l0 and key(0) in l0
    host.add(key(2), *entries[2], parent=key(1))
    buffers = slot()
    placed, loads = place_from_tiers(l0, host, chunks_of(8, 8, 8, 8), [key(i) for i in range(4)], buffers, 100)
    assert placed == 3  # chunk 0 from L0, chunks 1 and 2 from the host tier; chunk 3 is held by neither
    assert [(load.tier, load.num_chunks, load.num_bytes) for load in loads] == [("l0", 1, 800), ("host", 2, 1600)]
    for index in range(3):
        assert torch.equal(buffers[0][:, :, index * CHUNK : (index + 1) * CHUNK], entries[index][0])
        assert torch.equal(buffers[1][:, :, index * CHUNK : (index + 1) * CHUNK], entries[index][1])
    assert bool((buffers[0][:, :, 24:] == 7.0).all())


def test_adjacent_slabs_go_in_bounded_groups():
    assert _adjacent_groups([4, 5, 6, 9, 10, 2], 2) == [(4, 2), (6, 1), (9, 2), (2, 1)]
    assert _adjacent_groups([0, 1, 2, 3], 100) == [(0, 4)]


def test_a_failed_pinning_falls_back_to_pageable_memory_with_one_log_line(monkeypatch, caplog):
    def refuse(num_bytes):
        raise RuntimeError("cudaHostAlloc: out of locked memory")

    monkeypatch.setattr(host_tier_module, "empty_pinned", refuse)
    with caplog.at_level(logging.WARNING, logger="inference_service.kv_memory.host_tier"):
        host, entries = filled(2, 1, pin=True)
    assert not host.pinned and host.snapshot()["host_tier_pinned"] is False
    assert [record.message for record in caplog.records if "pinning" in record.message] == [
        f"host tier: pinning {2 * SLAB} bytes failed (cudaHostAlloc: out of locked memory); using pageable memory "
        "instead (copies to the device go through the driver's staging buffer)"]
    buffers = slot()
    assert host.place_run([key(0)], 0, buffers) == 1 and torch.equal(buffers[0][:, :, :CHUNK], entries[0][0])


def test_the_tier_is_off_below_one_slab_and_with_quantized_storage():
    assert host_tier_for(SLAB - 1, SHAPE, torch.float32, torch.device("cpu"), 16) is None
    assert host_tier_for(0, SHAPE, torch.float32, torch.device("cpu"), 16) is None
    assert host_tier_for(4 * SLAB, SHAPE, torch.float32, torch.device("cpu"), 8) is None
    host = host_tier_for(4 * SLAB + 5, SHAPE, torch.float32, torch.device("cpu"), 16)
    assert host is not None and host.max_bytes == 4 * SLAB and not host.pinned  # a CPU target: nothing to pin


@pytest.mark.parametrize("device_type, available, l0_host, expected", [
    ("cuda", 64 * GIB, 0, 16 * GIB),  # a quarter of the RAM available
    ("cuda", 64 * GIB, 4 * GIB, 12 * GIB),  # less what L0 takes of host memory
    ("cuda", 1024 * GIB, 0, HOST_TIER_MAX_BYTES),  # at most the cap
    ("cuda", 8 * GIB, 4 * GIB, 0),
    ("cpu", 64 * GIB, 0, 0),  # L0 already is host memory
])
def test_the_auto_host_tier_is_a_share_of_the_ram_on_cuda_and_off_on_a_cpu(device_type, available, l0_host, expected):
    assert plan_host_tier(device_type, available, l0_host) == expected


def test_snapshot_counts_hits_and_bytes():
    host, _ = filled(4, 2)
    host.place_run([key(0), key(1), key(2)], 0, slot())
    snapshot = host.snapshot()
    assert (snapshot["host_chunks_hit"], snapshot["host_bytes_placed"], snapshot["host_chunks_held"]) == (
        2, 2 * SLAB, 2)
    assert snapshot["host_bytes_held"] == 2 * SLAB and snapshot["host_tier_bytes"] == 4 * SLAB
    assert CAPACITY >= 32
