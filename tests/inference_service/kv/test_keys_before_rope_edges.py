"""Keys stored before RoPE, edge cases: content hits of flagged blobs, and the dynamic-RoPE position limit.

References are transformers' own RoPE (LlamaRotaryEmbedding, apply_rotary_pos_emb) applied to pre-RoPE keys
read from plain transformers (k_proj hooks) or to synthetic keys; never our own rotation code.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from inference_service.reuse.assembler import assemble_context
from inference_service.store.memory import InMemoryStore
from inference_service.kv.codec import decode_chunk
from inference_service.reuse.content_reuse import place_content_hits
from kvboost_keys.prompts import plan_prompt
from inference_service.kv.repair import APPROX, EXACT, MISSING
from inference_service.kv.rope import rope_parameters
from inference_service.kv_memory.kv_buffers import KVGeometry, allocate_kv, build_cache, kv_geometry
from inference_service.model.forward import prefill
from inference_service.reuse.writeback import PendingChunks, encode_pending
from tests.inference_service.kv.test_keys_before_rope import pre_rope_keys, relative_error

NAMESPACE = b"v" * 32


def token_run(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def rotate_with_transformers(config, unrotated: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """unrotated [..., tokens, head_dim] rotated to `positions` by transformers' Llama RoPE."""
    cos, sin = LlamaRotaryEmbedding(config)(unrotated, positions[None])
    rotated, _ = apply_rotary_pos_emb(unrotated, unrotated, cos, sin)
    return rotated


def warm_alone(model, cache, segment: list[int], chunk_size: int, bits: int, rope) -> None:
    """Stores a segment computed alone at positions 0.., as a document warmed on its own."""
    plan = plan_prompt(NAMESPACE, [segment, []], chunk_size)
    buffers = allocate_kv(kv_geometry(model.config), len(segment), model.device, model.dtype)
    _, new_kv = prefill(model, build_cache(model.config, *buffers, 0), torch.tensor(segment), 0)
    chunks = plan.chunks.chunks
    cache.store(encode_pending(PendingChunks(NAMESPACE, chunks, plan.prefix_keys, plan.content_keys, new_kv, 0),
                               bits, rope=rope))


def test_content_hits_of_unrotated_blobs_land_at_their_new_positions(tiny_llama):
    """Documents warmed alone at 0 (8 bits, keys before RoPE, partial last chunk) placed after a header."""
    model = tiny_llama[0]
    rope = rope_parameters(model.config)
    header, doc_a, doc_b, question = token_run(1, 10), token_run(2, 20), token_run(3, 12), token_run(5, 5)
    cache = InMemoryStore()
    for segment in (header, doc_a, doc_b):
        warm_alone(model, cache, segment, 8, 8, rope)
    assert all(decode_chunk(blob).header.keys_before_rope for _, blob in cache.fetch(list(cache._entries)))
    prompt = plan_prompt(NAMESPACE, [header, doc_a, doc_b, question], 8)
    capacity = prompt.num_tokens + 4
    context = assemble_context(cache, NAMESPACE, prompt, allocate_kv(kv_geometry(model.config), capacity, model.device, model.dtype), with_content_hits=True, rope=rope)
    assert context.num_cached_tokens == 10
    placed = place_content_hits(cache, prompt, context, kv_geometry(model.config), rope, allocate_kv(kv_geometry(model.config), capacity, model.device, model.dtype))
    assert placed.status.tolist() == [EXACT] * 10 + [APPROX] * 32 + [MISSING] * 5
    assert placed.seams.tolist() == [10, 30]  # B follows A in the prompt but starts over in storage
    assert placed.num_content_chunks == 5
    # Reference: each segment's pre-RoPE keys (alone, plain transformers) rotated by transformers' RoPE to
    # where the prompt places it.
    for segment, start in ((header, 0), (doc_a, 10), (doc_b, 30)):
        expected = rotate_with_transformers(model.config, pre_rope_keys(model, segment),
                                            torch.arange(start, start + len(segment)))
        got = placed.key_buffer[:, :, start : start + len(segment)]
        assert relative_error(got, expected) < 0.02, (start, relative_error(got, expected))
        # The sink token of each warmed document (its position 0) is stored as float16: exact to fp16.
        torch.testing.assert_close(got[:, :, 0], expected[:, :, 0], atol=2e-3, rtol=1e-3)


def synthetic_setup(limit: int):
    """A default-RoPE Llama config, its RopeParams with an artificial exact-position limit (as dynamic RoPE
    has), and K/V of 48 tokens: pre-RoPE keys near fixed channel values, and transformers-rotated ones."""
    num_layers, num_kv_heads, head_dim = 2, 2, 32
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                         num_hidden_layers=num_layers, max_position_embeddings=4096)
    rope = dataclasses.replace(rope_parameters(config), max_exact_position=limit, note="test limit")
    generator = torch.Generator().manual_seed(7)
    centres = torch.randn(num_layers, num_kv_heads, 1, head_dim, generator=generator) * 3
    unrotated = centres + 0.3 * torch.randn(num_layers, num_kv_heads, 48, head_dim, generator=generator)
    rotated = rotate_with_transformers(config, unrotated, torch.arange(48))
    values = torch.randn(num_layers, num_kv_heads, 48, head_dim, generator=generator)
    geometry = KVGeometry(num_layers, num_kv_heads, head_dim, 4096)
    return config, rope, geometry, unrotated, rotated, values


def test_chunks_beyond_the_rope_limit_are_stored_rotated_and_all_prefix_hits_come_back():
    _, rope, geometry, unrotated, rotated, values = synthetic_setup(limit=32)
    token_ids = token_run(11, 48)
    plan = plan_prompt(NAMESPACE, [token_ids], 16)
    new_kv = [(rotated[layer][None], values[layer][None]) for layer in range(geometry.num_layers)]
    cache = InMemoryStore()
    cache.store(encode_pending(PendingChunks(NAMESPACE, plan.chunks.chunks, plan.prefix_keys, plan.content_keys,
                                             new_kv, 0), 8, rope=rope))
    decoded = [decode_chunk(dict(cache.fetch([key]))[key]) for key in plan.prefix_keys]
    # 0..16 and 16..32 lie below the limit: un-rotated; 32..48 reaches it: stored as computed.
    assert [d.header.keys_before_rope for d in decoded] == [True, True, False]
    for d, (begin, end), reference in zip(decoded, [(0, 16), (16, 32), (32, 48)], [unrotated, unrotated, rotated]):
        assert relative_error(d.keys, reference[:, :, begin:end]) < 0.02
    context = assemble_context(cache, NAMESPACE, plan, allocate_kv(geometry, 48, torch.device("cpu"), torch.float32), with_content_hits=False, rope=rope)
    assert context.num_cached_tokens == 48
    assert relative_error(context.key_buffer[:, :, :48], rotated) < 0.02
    assert relative_error(context.value_buffer[:, :, :48], values) < 0.02


def test_an_unrotated_content_hit_beyond_the_rope_limit_stays_missing_and_others_still_land():
    config, rope, geometry, unrotated, rotated, values = synthetic_setup(limit=32)
    doc_a, doc_b = token_run(21, 8), token_run(22, 8)
    cache = InMemoryStore()
    for segment in (doc_a, doc_b):  # each warmed alone at 0..8 (same synthetic K/V: only positions matter)
        plan = plan_prompt(NAMESPACE, [segment, []], 8)
        new_kv = [(rotated[layer, :, :8][None], values[layer, :, :8][None]) for layer in range(geometry.num_layers)]
        cache.store(encode_pending(PendingChunks(NAMESPACE, plan.chunks.chunks, plan.prefix_keys,
                                                 plan.content_keys, new_kv, 0), 8, rope=rope))
    # A lands at 4..12 (below the limit), B at 36..44 (beyond it).
    prompt = plan_prompt(NAMESPACE, [token_run(23, 4), doc_a, token_run(24, 24), doc_b, token_run(25, 3)], 8)
    capacity = prompt.num_tokens
    context = assemble_context(cache, NAMESPACE, prompt, allocate_kv(geometry, capacity, torch.device("cpu"), torch.float32), with_content_hits=True, rope=rope)
    assert context.num_cached_tokens == 0 and len(context.content_hits) == 2
    placed = place_content_hits(cache, prompt, context, geometry, rope, allocate_kv(geometry, capacity, torch.device("cpu"), torch.float32))
    status = placed.status.tolist()
    assert status[4:12] == [APPROX] * 8 and status[36:44] == [MISSING] * 8
    assert placed.num_content_chunks == 1 and placed.seams.tolist() == [4]
    expected = rotate_with_transformers(config, unrotated[:, :, :8], torch.arange(4, 12))
    assert relative_error(placed.key_buffer[:, :, 4:12], expected) < 0.02


def test_a_prefix_run_ends_where_unrotated_keys_cannot_be_rotated_into_place():
    """Blobs flagged by a writer whose RoPE had no limit, read where rotation stops at 32: the run ends
    there (the chunks before it still match transformers), and rope=None refuses the first flagged chunk."""
    _, limited, geometry, _, rotated, values = synthetic_setup(limit=32)
    unlimited = dataclasses.replace(limited, max_exact_position=None)
    plan = plan_prompt(NAMESPACE, [token_run(31, 48)], 16)
    new_kv = [(rotated[layer][None], values[layer][None]) for layer in range(geometry.num_layers)]
    cache = InMemoryStore()
    cache.store(encode_pending(PendingChunks(NAMESPACE, plan.chunks.chunks, plan.prefix_keys, plan.content_keys,
                                             new_kv, 0), 4, rope=unlimited))
    assert all(decode_chunk(blob).header.keys_before_rope for _, blob in cache.fetch(list(plan.prefix_keys)))
    cpu = torch.device("cpu")
    full = assemble_context(cache, NAMESPACE, plan, allocate_kv(geometry, 48, cpu, torch.float32), with_content_hits=False, rope=unlimited)
    assert full.num_cached_tokens == 48 and relative_error(full.key_buffer[:, :, :48], rotated) < 0.2
    cut = assemble_context(cache, NAMESPACE, plan, allocate_kv(geometry, 48, cpu, torch.float32), with_content_hits=False, rope=limited)
    assert (cut.num_cached_tokens, cut.num_cached_chunks, cut.degraded) == (32, 2, False)
    torch.testing.assert_close(cut.key_buffer[:, :, :32], full.key_buffer[:, :, :32], atol=1e-5, rtol=0)
    none = assemble_context(cache, NAMESPACE, plan, allocate_kv(geometry, 48, cpu, torch.float32), with_content_hits=False, rope=None)
    assert (none.num_cached_tokens, none.key_buffer) == (0, None)


def test_chunks_left_rotated_keep_the_models_dtype_and_only_moved_ones_are_float32():
    """bf16 K/V: chunks below the RoPE limit are un-rotated in float32 (the blob says float32); the chunk
    beyond it is stored as computed, in bf16, not cast for nothing."""
    _, rope, geometry, _, rotated, values = synthetic_setup(limit=32)
    plan = plan_prompt(NAMESPACE, [token_run(41, 48)], 16)
    new_kv = [(rotated[layer][None].bfloat16(), values[layer][None].bfloat16()) for layer in range(geometry.num_layers)]
    items = encode_pending(PendingChunks(NAMESPACE, plan.chunks.chunks, plan.prefix_keys, plan.content_keys,
                                         new_kv, 0), 8, rope=rope)
    headers = [decode_chunk(item.blob).header for item in items]
    assert [(h.keys_before_rope, h.dtype) for h in headers] == [
        (True, "float32"), (True, "float32"), (False, "bfloat16")]
