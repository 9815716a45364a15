"""Tiers on CUDA (`pytest -m gpu`): placement from L0 in a few copies is bitwise the per-chunk copies and the daemon's
16-bit blobs on the device, and the default (auto) configuration sizes L0 and the slots from the device's memory."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.engine.memory_plan import CUDA_MIN_RESERVE_BYTES, size_tiers
from inference_service.kv.blobs import decode_hit, encode_chunk_kv, place_hit_
from inference_service.model.kv_buffers import kv_geometry
from inference_service.reuse import hot_placement
from inference_service.reuse.hot_placement import place_from_hot
from inference_service.reuse.hot_tier import HotTier
from inference_service.store.memory import InMemoryStore
from kvboost_keys.chunking import Chunk
from tests.factories import build_tiny_model

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("KVBOOST_TEST_DEVICE", "cuda")  # cpu: a dry run of this file's logic (tests/conftest.py)
LAYERS, HEADS, DIMS, CHUNK = 4, 2, 64, 16


@pytest.mark.parametrize("num_chunks, group_bytes", [(3, hot_placement.PLACEMENT_GROUP_BYTES), (300, 1 << 20)])
def test_placement_from_l0_is_bitwise_the_per_chunk_copies_and_the_daemons_blobs(num_chunks, group_bytes,
                                                                               monkeypatch):
    monkeypatch.setattr(hot_placement, "PLACEMENT_GROUP_BYTES", group_bytes)  # 300 chunks: many groups on CUDA
    capacity = num_chunks * CHUNK + 8
    generator = torch.Generator().manual_seed(num_chunks)
    chunks = [Chunk(tuple(range(i * CHUNK, (i + 1) * CHUNK)), i * CHUNK, 0) for i in range(num_chunks)]
    host_kv = [(torch.randn(LAYERS, HEADS, CHUNK, DIMS, generator=generator).to(torch.bfloat16),
                torch.randn(LAYERS, HEADS, CHUNK, DIMS, generator=generator).to(torch.bfloat16)) for _ in chunks]
    hot = HotTier(1 << 30)
    for index, (keys, values) in enumerate(host_kv):
        hot.add(index.to_bytes(4, "big"), keys.to(DEVICE), values.to(DEVICE),
                parent=(index - 1).to_bytes(4, "big") if index else None)

    def slot():
        return tuple(torch.zeros(LAYERS, HEADS, capacity, DIMS, dtype=torch.bfloat16, device=DEVICE) for _ in "kv")

    batched, per_chunk, from_blobs = slot(), slot(), slot()
    assert place_from_hot(hot, chunks, [i.to_bytes(4, "big") for i in range(num_chunks)], batched) == num_chunks
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
    assert sized.kv_cache_bytes > 0 and sized.hot_tier_bytes > 0
    if DEVICE == "cuda":
        free, _ = torch.cuda.mem_get_info()
        assert sized.kv_cache_bytes + sized.hot_tier_bytes <= free - CUDA_MIN_RESERVE_BYTES
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK), InMemoryStore(), model_id="tiny")
    try:
        prompt = ("Pump 7 is checked weekly; the valves are exercised monthly. " * 12)[:700]
        engine.generate(GenerationParams(prompt=prompt, max_new_tokens=4))
        engine.flush_writes()
        engine.generate(GenerationParams(prompt=prompt, max_new_tokens=4))
        assert engine.stats()["l0_chunks_hit"] >= 700 // CHUNK  # every whole chunk, from the first
    finally:
        engine.close()
