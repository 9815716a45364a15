"""One owner builds L0 and the host tier (kv_memory/memory_plan.build_tiers): the engine hands the same two to the
write-back and to its parts, L0's evictions go to the host tier, and without a cache neither is built."""
from __future__ import annotations

import torch

from inference_service.kv_memory.host_tier import HostTier
from inference_service.kv_memory.l0_tier import L0Tier
from inference_service.kv_memory.memory_plan import wire_tiers
from inference_service.store.protocol import NullStore
from tests.inference_service.engine.test_engine import make_engine

CHUNK = 8
CHUNK_BYTES = CHUNK * 512  # the tiny models' K/V: 512 bytes a token


def test_the_engine_hands_one_pair_of_tiers_to_the_write_back_and_its_parts(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=CHUNK, l0_bytes=3 * CHUNK_BYTES, host_tier_bytes=16 * CHUNK_BYTES)
    try:
        parts = engine.parts
        assert isinstance(parts.l0, L0Tier) and isinstance(parts.host, HostTier)
        assert parts.writeback.l0 is parts.l0 and parts.writeback.host is parts.host
        assert parts.l0.spill == parts.host.add  # wired once, by the owner
    finally:
        engine.close()


def test_without_a_cache_no_tier_is_built(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=CHUNK, cache=NullStore(), l0_bytes=3 * CHUNK_BYTES,
                         host_tier_bytes=16 * CHUNK_BYTES)
    try:
        assert (engine.parts.l0, engine.parts.host) == (None, None)
        assert (engine.parts.writeback.l0, engine.parts.writeback.host) == (None, None)
    finally:
        engine.close()


def test_wire_tiers_moves_what_l0_evicts_to_the_host_tier_and_counts_l0s_chunks_held():
    shape = (2, 1, CHUNK, 4)  # one chunk's slab: [layers, kv_heads, chunk, head_dim]
    slab_bytes = 2 * torch.Size(shape).numel() * 4  # keys and values, float32
    l0, host = L0Tier(2 * slab_bytes), HostTier(4, shape, torch.float32)

    def chunk(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full(shape, float(seed)), torch.full(shape, float(-seed))

    tiers = wire_tiers(l0, host)
    assert (tiers.l0, tiers.host) == (l0, host)
    l0.add(b"first", *chunk(1))
    l0.add(b"second", *chunk(2), parent=b"first")
    assert b"first" not in host and host.held_elsewhere(b"first")  # L0 holds it: the host tier counts it held
    l0.add(b"third", *chunk(3))  # L0 is full: a leaf leaves it, into the host tier
    assert len(host) == 1 and sum(key in l0 for key in (b"first", b"second", b"third")) == 2
    assert wire_tiers(None, host).host is host and wire_tiers(l0, None).l0 is l0  # one tier alone: nothing to wire
