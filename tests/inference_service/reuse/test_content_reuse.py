"""Tests for inference_service/content_reuse.py: documents warmed alone, reused in a new prompt by content."""
from __future__ import annotations

import pytest
import torch

from inference_service.reuse.assembler import assemble_context
from inference_service.store.memory import InMemoryStore
from inference_service.reuse.content_reuse import place_content_hits, prefill_with_content_hits
from kvboost_keys.prompts import plan_prompt
from inference_service.kv.repair import APPROX, EXACT, MISSING, RepairOptions
from inference_service.kv.rope import rerotate_keys, rope_parameters
from inference_service.kv_memory.kv_buffers import allocate_kv, build_cache, kv_geometry
from inference_service.model.forward import prefill
from inference_service.reuse.writeback import PendingChunks, encode_pending

NAMESPACE = b"n" * 32
CHUNK_SIZE = 8


def token_run(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# A prompt of four segments: header (10 tokens), document A (20), document B (12), question (5).
HEADER, DOC_A, DOC_B, DOC_C, QUESTION = token_run(1, 10), token_run(2, 20), token_run(3, 12), token_run(4, 16), token_run(5, 5)


def warm_segment(model, cache: InMemoryStore, segment: list[int], bits: int = 16) -> None:
    """Stores a segment's chunks as they appear inside a prompt: keyed from its start, partial last chunk included."""
    plan = plan_prompt(NAMESPACE, [segment, []], CHUNK_SIZE)
    _, new_kv = prefill_alone(model, segment)
    chunks = plan.chunks.chunks
    cache.store(encode_pending(PendingChunks(NAMESPACE, chunks, plan.prefix_keys, plan.content_keys, new_kv, 0), bits))


def prefill_alone(model, token_ids: list[int]):
    """(logits, per-layer K/V) of the tokens run alone at positions 0.."""
    buffers = allocate_kv(kv_geometry(model.config), len(token_ids), model.device, model.dtype)
    return prefill(model, build_cache(model.config, *buffers, 0), torch.tensor(token_ids), 0)


def assemble(model, cache, segments, capacity_room: int = 4):
    """(prompt, context) as the engine assembles them, with buffers for the prompt plus capacity_room tokens."""
    prompt = plan_prompt(NAMESPACE, segments, CHUNK_SIZE)
    capacity = prompt.num_tokens + capacity_room
    context = assemble_context(cache, NAMESPACE, prompt, allocate_kv(kv_geometry(model.config), capacity, model.device, model.dtype), with_content_hits=True)
    return prompt, context, capacity


def reuse(model, cache, segments, options=RepairOptions(strategy="cacheblend", recompute_ratio=1.0)):
    prompt, context, capacity = assemble(model, cache, segments)
    return prompt, context, prefill_with_content_hits(model, cache, prompt, context, kv_geometry(model.config), rope_parameters(model.config), options, allocate_kv(kv_geometry(model.config), capacity, model.device, model.dtype))


@pytest.fixture()
def warmed(tiny_llama):
    """The header warmed as a prefix, documents A and B warmed alone."""
    model = tiny_llama[0]
    cache = InMemoryStore()
    for segment in (HEADER, DOC_A, DOC_B):
        warm_segment(model, cache, segment)
    return model, cache


def test_content_hits_are_placed_rerotated_with_seams_at_each_document(warmed):
    model, cache = warmed
    prompt, context, capacity = assemble(model, cache, [HEADER, DOC_A, DOC_B, QUESTION])
    placed = place_content_hits(cache, prompt, context, kv_geometry(model.config), rope_parameters(model.config), allocate_kv(kv_geometry(model.config), capacity, model.device, model.dtype))
    # Header 0..10 is the prefix run (chunks 0..8, 8..10); A is 10..30, B 30..42, the question 42..47.
    expected = [EXACT] * 10 + [APPROX] * 32 + [MISSING] * 5
    assert placed.status.tolist() == expected
    # B follows A directly, but B's stored run starts over at position 0: a seam.
    assert placed.seams.tolist() == [10, 30]
    assert placed.num_content_chunks == 5  # A: 8+8+4, B: 8+4
    # A's K/V were computed at 0..20 alone: its keys are those, rotated by +10.
    _, alone = prefill_alone(model, DOC_A)
    alone_keys = torch.stack([layer_keys[0] for layer_keys, _ in alone])
    moved = rerotate_keys(alone_keys, torch.arange(20), torch.arange(10, 30), rope_parameters(model.config))
    torch.testing.assert_close(placed.key_buffer[:, :, 10:30], moved, atol=1e-6, rtol=0)


def test_full_recompute_of_content_hits_equals_plain_forward(warmed):
    model, cache = warmed
    segments = [HEADER, DOC_B, DOC_A, QUESTION]  # a new order
    prompt, _, prefilled = reuse(model, cache, segments)
    with torch.no_grad():
        logits = model(torch.tensor([prompt.token_ids])).logits[0, -1]
    torch.testing.assert_close(prefilled.first_logits, logits, atol=1e-4, rtol=0)
    assert (prefilled.num_cached_tokens, prefilled.num_recomputed_tokens) == (42, 32)
    assert prefilled.cache.get_seq_length() == prompt.num_tokens
    # Decoding goes on in the buffers' spare room: one more token matches a plain forward of it all.
    next_id = torch.tensor([[65]])
    with torch.no_grad():
        step = model(next_id, position_ids=torch.tensor([[prompt.num_tokens]]), past_key_values=prefilled.cache,
                     use_cache=True).logits[0, -1]
        whole = model(torch.tensor([[*prompt.token_ids, 65]])).logits[0, -1]
    torch.testing.assert_close(step, whole, atol=1e-4, rtol=0)


def test_without_repair_the_reused_documents_stay_approximate(warmed):
    model, cache = warmed
    prompt, _, prefilled = reuse(model, cache, [HEADER, DOC_B, DOC_A, QUESTION], RepairOptions(strategy="none"))
    with torch.no_grad():
        logits = model(torch.tensor([prompt.token_ids])).logits[0, -1]
    assert prefilled.num_recomputed_tokens == 0
    assert (prefilled.first_logits - logits).abs().max() > 1e-4


def test_nothing_to_reuse_by_content_gives_none(warmed, tiny_llama):
    model, cache = warmed
    # Only the header is known: no content hit after the prefix run.
    assert reuse(model, cache, [HEADER, DOC_C, QUESTION])[2] is None
    prompt, context, capacity = assemble(model, cache, [HEADER, DOC_A, QUESTION])
    # No RoPE parameters (an unsupported rotary embedding): content hits are not used.
    assert prefill_with_content_hits(model, cache, prompt, context, kv_geometry(model.config), None, RepairOptions(), allocate_kv(kv_geometry(model.config), capacity, model.device, model.dtype)) is None


def test_quantized_content_hits_are_placed(tiny_llama):
    model = tiny_llama[0]
    logits = {}
    for bits in (16, 8):
        cache = InMemoryStore()
        for segment in (HEADER, DOC_A):
            warm_segment(model, cache, segment, bits=bits)
        _, _, prefilled = reuse(model, cache, [HEADER, DOC_A, QUESTION], RepairOptions(strategy="none"))
        assert prefilled.num_cached_tokens == 30
        logits[bits] = prefilled.first_logits
    # int8 keys and values: close to, not equal to, the same reuse at 16 bits.
    assert not torch.equal(logits[8], logits[16])
    assert torch.nn.functional.cosine_similarity(logits[8], logits[16], dim=0) > 0.999
