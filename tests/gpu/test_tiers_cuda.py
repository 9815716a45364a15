"""Tiers on CUDA (`pytest -m gpu`): placement from L0 in a few copies and from the pinned host tier is bitwise the
per-chunk copies and the daemon's 16-bit blobs on the device, a host slab is not refilled before its copy to the device
ends, and the default (auto) configuration sizes L0 and the slots from the device's memory."""
from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.kv_memory.memory_plan import CUDA_MIN_RESERVE_BYTES, size_tiers
from inference_service.kv.blobs import decode_hit, encode_chunk_kv, place_hit_
from inference_service.kv_memory.kv_buffers import kv_geometry
from inference_service.kv_memory import tier_placement
from inference_service.kv_memory.host_tier import HostTier
from inference_service.kv_memory.l0_tier import L0Tier
from inference_service.kv_memory.tier_placement import place_from_l0
from inference_service.store.memory import InMemoryStore
from kvboost_keys.chunking import Chunk
from tests.factories import build_tiny_model

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("KVBOOST_TEST_DEVICE", "cuda")  # cpu: a dry run of this file's logic (tests/conftest.py)
LAYERS, HEADS, DIMS, CHUNK = 4, 2, 64, 16


@pytest.mark.parametrize("num_chunks, group_bytes", [(3, tier_placement.PLACEMENT_GROUP_BYTES), (300, 1 << 20)])
def test_placement_from_l0_is_bitwise_the_per_chunk_copies_and_the_daemons_blobs(num_chunks, group_bytes,
                                                                               monkeypatch):
    monkeypatch.setattr(tier_placement, "PLACEMENT_GROUP_BYTES", group_bytes)  # 300 chunks: many groups on CUDA
    capacity = num_chunks * CHUNK + 8
    generator = torch.Generator().manual_seed(num_chunks)
    chunks = [Chunk(tuple(range(i * CHUNK, (i + 1) * CHUNK)), i * CHUNK, 0) for i in range(num_chunks)]
    host_kv = [(torch.randn(LAYERS, HEADS, CHUNK, DIMS, generator=generator).to(torch.bfloat16),
                torch.randn(LAYERS, HEADS, CHUNK, DIMS, generator=generator).to(torch.bfloat16)) for _ in chunks]
    l0 = L0Tier(1 << 30)
    for index, (keys, values) in enumerate(host_kv):
        l0.add(index.to_bytes(4, "big"), keys.to(DEVICE), values.to(DEVICE),
                parent=(index - 1).to_bytes(4, "big") if index else None)

    def slot():
        return tuple(torch.zeros(LAYERS, HEADS, capacity, DIMS, dtype=torch.bfloat16, device=DEVICE) for _ in "kv")

    batched, per_chunk, from_blobs = slot(), slot(), slot()
    assert place_from_l0(l0, chunks, [i.to_bytes(4, "big") for i in range(num_chunks)], batched) == num_chunks
    for chunk, (keys, values) in zip(chunks, host_kv):
        span = slice(chunk.start, chunk.end)
        per_chunk[0][:, :, span].copy_(keys)
        per_chunk[1][:, :, span].copy_(values)
        blob = encode_chunk_kv(keys, values, chunk.start, 16)
        decoded = decode_hit(b"k", b"k", blob, chunk.start, CHUNK, (LAYERS, HEADS, chunk.end, DIMS), True,
                             device=DEVICE)
        assert place_hit_(from_blobs[0][:, :, span], from_blobs[1][:, :, span], decoded, chunk.start, None)
    for placed, reference, daemon in zip(batched, per_chunk, from_blobs):
        assert torch.equal(placed.view(torch.int16), reference.view(torch.int16))
        assert torch.equal(placed.view(torch.int16), daemon.view(torch.int16))


def test_the_default_configuration_sizes_the_tiers_from_the_device_and_a_repeated_prompt_hits_l0():
    model, tokenizer = build_tiny_model("llama")
    model = copy.deepcopy(model).to(DEVICE)
    sized = size_tiers(EngineConfig(chunk_size=CHUNK), model, kv_geometry(model.config))
    assert sized.kv_cache_bytes > 0 and sized.l0_bytes > 0
    if DEVICE == "cuda":
        free, _ = torch.cuda.mem_get_info()
        assert sized.kv_cache_bytes + sized.l0_bytes <= free - CUDA_MIN_RESERVE_BYTES
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK), InMemoryStore(), model_id="tiny")
    try:
        prompt = ("Pump 7 is checked weekly; the valves are exercised monthly. " * 12)[:700]
        engine.generate(GenerationParams(prompt=prompt, max_new_tokens=4))
        engine.flush_writes()
        engine.generate(GenerationParams(prompt=prompt, max_new_tokens=4))
        assert engine.stats()["l0_chunks_hit"] >= 700 // CHUNK  # every whole chunk, from the first
    finally:
        engine.close()


def _pinned_host_tier(num_slabs: int) -> HostTier:
    host = HostTier(num_slabs, (LAYERS, HEADS, CHUNK, DIMS), torch.bfloat16, pin=DEVICE == "cuda")
    if DEVICE == "cuda":  # registered once: the copy engine reads the slabs directly
        assert host.pinned and host.region.is_pinned()
    return host


def test_placement_from_the_host_tier_is_bitwise_the_daemons_blobs():
    num_chunks = 40
    generator = torch.Generator().manual_seed(7)
    chunks = [Chunk(tuple(range(i * CHUNK, (i + 1) * CHUNK)), i * CHUNK, 0) for i in range(num_chunks)]
    host_kv = [(torch.randn(LAYERS, HEADS, CHUNK, DIMS, generator=generator).to(torch.bfloat16),
                torch.randn(LAYERS, HEADS, CHUNK, DIMS, generator=generator).to(torch.bfloat16)) for _ in chunks]
    host = _pinned_host_tier(num_chunks)
    for index, (keys, values) in enumerate(host_kv):  # from the device, as L0's evictions and fetched chunks come
        assert host.add(index.to_bytes(4, "big"), keys.to(DEVICE), values.to(DEVICE),
                        parent=(index - 1).to_bytes(4, "big") if index else None)

    def slot():
        return tuple(torch.zeros(LAYERS, HEADS, num_chunks * CHUNK + 8, DIMS, dtype=torch.bfloat16, device=DEVICE)
                     for _ in "kv")

    from_host, from_blobs = slot(), slot()
    assert host.place_run([i.to_bytes(4, "big") for i in range(num_chunks)], 0, from_host) == num_chunks
    for chunk, (keys, values) in zip(chunks, host_kv):
        span = slice(chunk.start, chunk.end)
        blob = encode_chunk_kv(keys, values, chunk.start, 16)
        decoded = decode_hit(b"k", b"k", blob, chunk.start, CHUNK, (LAYERS, HEADS, chunk.end, DIMS), True,
                             device=DEVICE)
        assert place_hit_(from_blobs[0][:, :, span], from_blobs[1][:, :, span], decoded, chunk.start, None)
    for placed, daemon in zip(from_host, from_blobs):
        assert torch.equal(placed.view(torch.int16), daemon.view(torch.int16))
    assert bool((from_host[0][:, :, num_chunks * CHUNK :] == 0).all())


def test_a_slab_is_not_overwritten_before_its_copy_to_the_device_completes():
    """The copy out of the only slab is queued behind a long kernel on another stream; a new chunk then evicts it and
    is written into the same slab from this thread's stream. Without the event recorded after the copy (which the
    fill's side stream waits for), the fill would land first and the slot would get the new chunk's bytes."""
    generator = torch.Generator().manual_seed(3)
    first, second = ((torch.randn(LAYERS, HEADS, CHUNK, DIMS, generator=generator).to(torch.bfloat16).to(DEVICE),
                      torch.randn(LAYERS, HEADS, CHUNK, DIMS, generator=generator).to(torch.bfloat16).to(DEVICE))
                     for _ in range(2))
    host = _pinned_host_tier(1)
    assert host.add(b"first", *first)
    buffers = tuple(torch.zeros(LAYERS, HEADS, CHUNK, DIMS, dtype=torch.bfloat16, device=DEVICE) for _ in "kv")
    other = torch.cuda.Stream() if DEVICE == "cuda" else None
    with torch.cuda.stream(other) if other is not None else contextlib.nullcontext():
        if other is not None:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning before the copy may start
        assert host.place_run([b"first"], 0, buffers) == 1
    assert host.add(b"second", *second)  # evicts "first" (a leaf) and reuses its slab
    assert b"first" not in host and host.stats.chunks_evicted == 1
    if other is not None:
        torch.cuda.current_stream().wait_stream(other)
        torch.cuda.synchronize()
    assert torch.equal(buffers[0].view(torch.int16), first[0].view(torch.int16))
    assert torch.equal(buffers[1].view(torch.int16), first[1].view(torch.int16))


def test_a_prompt_placed_from_the_host_tier_on_the_device_answers_as_the_baseline():
    model, tokenizer = build_tiny_model("llama")
    model = copy.deepcopy(model).to(DEVICE)
    config = EngineConfig(chunk_size=CHUNK, kv_cache_bytes=256 << 20, l0_bytes=0, host_tier_bytes=64 << 20)
    engine = Engine(model, tokenizer, config, InMemoryStore(), model_id="tiny")
    try:
        prompt = ("Pump 7 is checked weekly; the valves are exercised monthly. " * 12)[:700]
        baseline = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=8, mode="baseline"))
        engine.generate(GenerationParams(prompt=prompt, max_new_tokens=8))
        engine.flush_writes()
        repeat = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=8))
        stats = engine.stats()
        assert stats["host_chunks_hit"] >= 700 // CHUNK - 1 and stats["tier_loads"]["host"]["chunks"] > 0
        assert repeat.output_token_ids == baseline.output_token_ids
        assert stats["host_tier_pinned"] is (DEVICE == "cuda")
    finally:
        engine.close()
