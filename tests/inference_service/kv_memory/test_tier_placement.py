"""Placement from L0 in a few copies: bitwise what one copy per chunk (the old path) and the daemon's blobs give."""
from __future__ import annotations

import torch

from inference_service.kv.blobs import decode_hit, encode_chunk_kv, place_hit_
from inference_service.kv_memory import tier_placement
from inference_service.kv_memory.l0_tier import L0Tier
from inference_service.kv_memory.tier_placement import copy_run_, place_from_l0
from kvboost_keys.chunking import Chunk

LAYERS, HEADS, DIMS, CAPACITY = 2, 3, 5, 40


def chunks_of(*lengths: int) -> list[Chunk]:
    chunks, start = [], 0
    for length in lengths:
        chunks.append(Chunk(tuple(range(start, start + length)), start, 0))
        start += length
    return chunks


def kv(length: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(LAYERS, HEADS, length, DIMS, generator=generator).to(dtype),
            torch.randn(LAYERS, HEADS, length, DIMS, generator=generator).to(dtype))


def slot(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((LAYERS, HEADS, CAPACITY, DIMS), 7.0, dtype=dtype),
            torch.full((LAYERS, HEADS, CAPACITY, DIMS), 7.0, dtype=dtype))


def test_a_run_from_l0_is_bitwise_one_copy_per_chunk_and_leaves_the_rest_of_the_slot_alone():
    for dtype in (torch.float32, torch.bfloat16):
        chunks = chunks_of(8, 8, 8, 5)  # three whole chunks and a partial one
        entries = [kv(len(chunk.token_ids), seed, dtype) for seed, chunk in enumerate(chunks)]
        l0 = L0Tier(1 << 20)
        for index, entry in enumerate(entries):
            l0.add(bytes([index]), *entry, parent=bytes([index - 1]) if index else None)
        batched, per_chunk = slot(dtype), slot(dtype)
        assert place_from_l0(l0, chunks, [bytes([i]) for i in range(4)], batched) == 4
        for chunk, (keys, values) in zip(chunks, entries):  # the old path: two copies per chunk
            per_chunk[0][:, :, chunk.start : chunk.end].copy_(keys)
            per_chunk[1][:, :, chunk.start : chunk.end].copy_(values)
        assert all(torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
                   for a, b in zip(batched, per_chunk))
        assert bool((batched[0][:, :, 29:] == 7.0).all())  # past the run: untouched


def test_placement_from_l0_is_bitwise_what_the_daemons_16_bit_blobs_place():
    chunks = chunks_of(8, 8)
    entries = [kv(8, seed) for seed in range(2)]
    l0 = L0Tier(1 << 20)
    for index, entry in enumerate(entries):
        l0.add(bytes([index]), *entry, parent=bytes([index - 1]) if index else None)
    from_l0, from_blobs = slot(), slot()
    place_from_l0(l0, chunks, [b"\x00", b"\x01"], from_l0)
    for index, (chunk, (keys, values)) in enumerate(zip(chunks, entries)):
        blob = encode_chunk_kv(keys, values, chunk.start, 16)
        shape = (LAYERS, HEADS, chunk.end, DIMS)
        decoded = decode_hit(bytes([index]), bytes([index]), blob, chunk.start, 8, shape, True)
        span = slice(chunk.start, chunk.end)
        assert place_hit_(from_blobs[0][:, :, span], from_blobs[1][:, :, span], decoded, chunk.start, None)
    assert torch.equal(from_l0[0], from_blobs[0]) and torch.equal(from_l0[1], from_blobs[1])


def test_the_run_stops_at_the_first_chunk_l0_does_not_hold():
    chunks = chunks_of(8, 8, 8)
    l0 = L0Tier(1 << 20)
    l0.add(b"a", *kv(8, 0))
    l0.add(b"c", *kv(8, 2), parent=b"b")
    buffers = slot()
    assert place_from_l0(l0, chunks, [b"a", b"b", b"c"], buffers) == 1
    assert bool((buffers[0][:, :, 8:] == 7.0).all())
    assert place_from_l0(None, chunks, [b"a"], buffers) == 0


def test_groups_bound_the_temporaries_and_keep_the_order(monkeypatch):
    monkeypatch.setattr(tier_placement, "PLACEMENT_GROUP_BYTES", 2 * LAYERS * HEADS * 8 * DIMS * 4)
    parts = [torch.full((LAYERS, HEADS, 8, DIMS), float(i)) for i in range(5)]
    assert [len(group) for group in tier_placement._groups(parts, tier_placement.PLACEMENT_GROUP_BYTES)] == [2, 2, 1]
    buffers = slot()
    copy_run_([(part, -part) for part in parts], 0, buffers)
    assert [float(buffers[0][0, 0, 8 * i, 0]) for i in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
