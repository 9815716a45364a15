"""Quantized keys stored before RoPE: un-rotated at write-back, rotated back into place on every hit."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from inference_service.reuse.assembler import assemble_context
from inference_service.store.memory import InMemoryStore
from inference_service.kv.codec import decode_chunk
from inference_service.engine.engine import Engine, EngineConfig
from kvboost_keys.prompts import plan_prompt
from inference_service.kv.rope import rope_parameters
from inference_service.kv_memory.kv_buffers import allocate_kv, build_cache, kv_geometry
from inference_service.model.forward import prefill
from inference_service.reuse.writeback import PendingChunks, encode_pending

NAMESPACE = b"r" * 32
CHUNK_SIZE = 16


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


def model_kv(model, token_ids: list[int]):
    """Per-layer (keys, values) [1, kv_heads, n, head_dim] of a plain prefill at positions 0.."""
    buffers = allocate_kv(kv_geometry(model.config), len(token_ids), model.device, model.dtype)
    return prefill(model, build_cache(model.config, *buffers, 0), torch.tensor(token_ids), 0)[1]


def pre_rope_keys(model, token_ids: list[int]) -> torch.Tensor:
    """[layers, kv_heads, n, head_dim]: each layer's k_proj output, read by hooks on plain transformers."""
    captured = []
    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda _m, _i, out: captured.append(out))
             for layer in model.model.layers]
    try:
        with torch.inference_mode():
            model(torch.tensor([token_ids]))
    finally:
        for hook in hooks:
            hook.remove()
    head_dim = model.config.head_dim
    return torch.stack([out[0].view(len(token_ids), -1, head_dim).transpose(0, 1) for out in captured])


def store(cache, plan, new_kv, bits, rope) -> None:
    pending = PendingChunks(NAMESPACE, plan.chunks.chunks, plan.prefix_keys, plan.content_keys, new_kv, 0)
    cache.store(encode_pending(pending, bits, rope=rope))


def tokens(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("bits", [8, 4])
def test_stored_keys_are_the_models_keys_before_rope(tiny_llama, bits):
    model = tiny_llama[0]
    token_ids = tokens(64)
    plan = plan_prompt(NAMESPACE, [token_ids], CHUNK_SIZE)
    cache = InMemoryStore()
    store(cache, plan, model_kv(model, token_ids), bits, rope_parameters(model.config))
    unrotated = pre_rope_keys(model, token_ids)
    tolerance = 0.02 if bits == 8 else 0.2
    for chunk, key in zip(plan.chunks.chunks, plan.prefix_keys):
        decoded = decode_chunk(dict(cache.fetch([key]))[key])
        assert decoded.header.keys_before_rope
        assert decoded.header.start_position == chunk.start
        assert relative_error(decoded.keys, unrotated[:, :, chunk.start : chunk.end]) < tolerance


@pytest.mark.parametrize("bits", [8, 4])
def test_prefix_hits_rotate_unrotated_keys_back_into_place(tiny_llama, bits):
    model = tiny_llama[0]
    token_ids = tokens(80, seed=1)
    plan = plan_prompt(NAMESPACE, [token_ids], CHUNK_SIZE)
    new_kv = model_kv(model, token_ids)
    rope = rope_parameters(model.config)
    cache = InMemoryStore()
    store(cache, plan, new_kv, bits, rope)
    context = assemble_context(cache, NAMESPACE, plan, allocate_kv(kv_geometry(model.config), len(token_ids), model.device, model.dtype), with_content_hits=False, rope=rope)
    assert context.num_cached_tokens == 80
    tolerance = 0.02 if bits == 8 else 0.2
    for layer, (keys, values) in enumerate(new_kv):
        assert relative_error(context.key_buffer[layer, :, :80], keys[0]) < tolerance
        assert relative_error(context.value_buffer[layer, :, :80], values[0]) < tolerance


def test_unrotated_keys_cannot_be_placed_without_rope(tiny_llama):
    model = tiny_llama[0]
    token_ids = tokens(48, seed=2)
    plan = plan_prompt(NAMESPACE, [token_ids], CHUNK_SIZE)
    cache = InMemoryStore()
    store(cache, plan, model_kv(model, token_ids), 8, rope_parameters(model.config))
    context = assemble_context(cache, NAMESPACE, plan, allocate_kv(kv_geometry(model.config), len(token_ids), model.device, model.dtype), with_content_hits=False, rope=None)
    assert context.num_cached_tokens == 0 and not context.degraded  # recomputed, not misplaced


def test_quantizing_keys_before_rope_loses_less():
    """Keys whose channels sit near fixed values before RoPE (as real keys do: outlier channels) spread over
    +-their pair's norm once rotated at far positions; per-channel groups then need a far wider range."""
    head_dim, num_layers, num_kv_heads, num_tokens, start = 64, 2, 2, 64, 3000
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(num_layers, num_kv_heads, 1, head_dim, generator=generator) * 4
    unrotated = centres + 0.3 * torch.randn(num_layers, num_kv_heads, num_tokens, head_dim, generator=generator)
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                         num_hidden_layers=num_layers, max_position_embeddings=8192)
    positions = torch.arange(start, start + num_tokens)[None]
    cos, sin = LlamaRotaryEmbedding(config)(unrotated, positions)  # transformers' own RoPE
    rotated, _ = apply_rotary_pos_emb(unrotated, unrotated, cos, sin)
    new_kv = [(rotated[layer][None], torch.zeros_like(rotated[layer][None])) for layer in range(num_layers)]
    chunk_tokens = tokens(num_tokens, seed=3)
    plan = plan_prompt(NAMESPACE, [tokens(start, seed=4), chunk_tokens], num_tokens)
    chunk_index = len(plan.chunks.chunks) - 1
    assert plan.chunks.chunks[chunk_index].start == start
    pending = PendingChunks(NAMESPACE, plan.chunks.chunks[chunk_index:], plan.prefix_keys[chunk_index:],
                            plan.content_keys[chunk_index:], new_kv, kv_start=start)
    rope = rope_parameters(config)
    errors = {}
    for name, stored_with in (("before", rope), ("after", None)):
        decoded = decode_chunk(encode_pending(pending, 8, rope=stored_with)[0].blob)
        keys = decoded.keys
        if decoded.header.keys_before_rope:
            keys, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
        errors[name] = relative_error(keys, rotated)
    assert errors["before"] < 0.5 * errors["after"], errors


def test_engine_stores_keys_before_rope_at_8_and_4_bits_only_when_asked(tiny_llama):
    model, tokenizer = tiny_llama
    flags = {}
    for bits, before in ((8, True), (4, True), (8, False), (4, False), (16, True)):
        cache = InMemoryStore()
        engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, kv_cache_bits=bits, kv_keys_before_rope=before),
                        cache, model_id="tiny")
        try:
            engine.warm("The quick brown fox jumps over the lazy dog.")
        finally:
            engine.close()
        blobs = [blob for _, blob in cache.fetch(list(cache._entries))]
        flags[bits, before] = {decode_chunk(blob).header.keys_before_rope for blob in blobs}
    assert flags == {(8, True): {True}, (4, True): {True}, (8, False): {False}, (4, False): {False},
                     (16, True): {False}}
    default = EngineConfig(kv_cache_bits=8)
    assert not default.kv_keys_before_rope and not default.keys_before_rope  # opt-in


def test_bfloat16_keys_are_moved_in_float32_and_rounded_once():
    """A bf16 model's keys are un-rotated and quantized in float32 (the blob says float32) and rotated back in
    float32 before they are rounded into the bf16 buffer: less error than storing them after RoPE."""
    from transformers import LlamaConfig

    head_dim, num_layers, num_kv_heads, num_tokens = 64, 2, 2, 256
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                         num_hidden_layers=num_layers, max_position_embeddings=4096)
    generator = torch.Generator().manual_seed(5)
    centres = torch.randn(num_layers, num_kv_heads, 1, head_dim, generator=generator) * 4
    unrotated = centres + 0.3 * torch.randn(num_layers, num_kv_heads, num_tokens, head_dim, generator=generator)
    cos, sin = LlamaRotaryEmbedding(config)(unrotated, torch.arange(num_tokens)[None])
    rotated = apply_rotary_pos_emb(unrotated, unrotated, cos, sin)[0].bfloat16()  # what a bf16 model holds
    new_kv = [(rotated[layer][None], torch.ones_like(rotated[layer][None])) for layer in range(num_layers)]
    plan = plan_prompt(NAMESPACE, [tokens(num_tokens, seed=6)], 64)
    rope = rope_parameters(config)
    errors = {}
    for name, stored_with in (("before", rope), ("after", None)):
        items = encode_pending(PendingChunks(NAMESPACE, plan.chunks.chunks, plan.prefix_keys, plan.content_keys,
                                             new_kv, 0), 8, rope=stored_with)
        dtypes = {decode_chunk(item.blob).header.dtype for item in items}
        assert dtypes == ({"float32"} if stored_with else {"bfloat16"})
        cache = InMemoryStore()
        cache.store(items)
        geometry = kv_geometry(config)
        context = assemble_context(cache, NAMESPACE, plan, allocate_kv(geometry, num_tokens, torch.device("cpu"), torch.bfloat16), with_content_hits=False, rope=rope)
        assert context.num_cached_tokens == num_tokens and context.key_buffer.dtype == torch.bfloat16
        errors[name] = relative_error(context.key_buffer[:, :, :num_tokens].float(), rotated.float())
    assert errors["before"] < 0.6 * errors["after"], errors
