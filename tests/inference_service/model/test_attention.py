"""The engine's attention: a registered implementation chosen per call, bit-identical to transformers' own SDPA,
and never taken by a plain model call, even one running beside the engine's forwards."""
from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from transformers.integrations import sdpa_attention
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.model import attention
from inference_service.model.attention import (ENGINE_ATTENTION, LIVE_CAUSAL, live_causal_attention, live_causal_mask,
                                               use_engine_attention)
from inference_service.model import forward as forward_module
from inference_service.model.forward import decode_alone, prefill
from inference_service.kv_memory.kv_buffers import allocate_kv, build_cache, kv_geometry
from inference_service.store.memory import InMemoryStore
from tests.conftest import wait_for
from tests.factories import build_tiny_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2  # 90 byte tokens: several chunks of 8


@pytest.fixture()
def calls_by_thread(monkeypatch) -> Counter:
    """(thread id, "engine" or "default") for every attention call: which path each thread's forwards took."""
    seen: Counter = Counter()
    grouped, default = attention.grouped_sdpa, sdpa_attention.sdpa_attention_forward

    def counting_default(*args, **kwargs):
        seen[(threading.get_ident(), "default")] += 1
        return default(*args, **kwargs)

    def counting_grouped(*args, **kwargs):
        seen[(threading.get_ident(), "engine")] += 1
        return grouped(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counting_default)
    monkeypatch.setattr(attention, "grouped_sdpa", counting_grouped)
    return seen


def plain_generate(model, prompt_ids: list[int], max_new_tokens: int = 8) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens)
    return output[0, len(prompt_ids):].tolist()


def test_a_plain_generate_beside_the_engines_forwards_runs_transformers_default_attention(calls_by_thread):
    model, tokenizer = build_tiny_model("llama")  # 4 query heads over 2 K/V heads
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected = plain_generate(model, prompt_ids)  # before any engine touched the model
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="tiny")
    assert model.config._attn_implementation == ENGINE_ATTENTION
    calls_by_thread.clear()

    # The engine decodes long requests on its thread while the test thread runs plain generates on the same model.
    running = threading.Event()
    outcomes = []
    engine.submit(GenerationParams(prompt=PROMPT, max_new_tokens=200), lambda event: running.set(), lambda: False,
                  lambda result, error: outcomes.append(error or result))
    running.wait(30)
    plain = [plain_generate(model, prompt_ids) for _ in range(3)]
    engine_thread = engine.core._thread.ident
    engine_busy_meanwhile = not outcomes
    wait_for(lambda: outcomes, timeout_s=60, what="the engine's request to end")

    assert engine_busy_meanwhile, "the plain generates ran while the engine was decoding"
    assert plain == [expected] * 3
    me = threading.get_ident()
    assert calls_by_thread[(me, "default")] > 0 and calls_by_thread[(me, "engine")] == 0
    assert calls_by_thread[(engine_thread, "engine")] > 0  # its prefills (its decode steps keep pack_gqa)
    engine.stop()


def test_the_engines_grouped_sdpa_is_bit_identical_to_transformers_default(monkeypatch):
    model, tokenizer = build_tiny_model("llama")
    use_engine_attention(model)
    monkeypatch.setattr(forward_module, "live_causal_mask", lambda *args: None)  # the suffix's mask, built as before
    token_ids = torch.tensor(tokenizer(PROMPT, add_special_tokens=False)["input_ids"][:40])

    def forwards() -> list[torch.Tensor]:
        cache = build_cache(model.config, *allocate_kv(kv_geometry(model.config), 48, "cpu", torch.float32), 0)
        first, _ = prefill(model, cache, token_ids[:32], 0)
        suffix, _ = prefill(model, cache, token_ids[32:], 32)  # masked: where grouped SDPA differs in how it runs
        return [first, suffix, decode_alone(model, cache, suffix.argmax(), 40)]

    engine = forwards()
    monkeypatch.setattr(forward_module, "engine_call_kwargs", lambda: {})  # the same calls without the engine's keyword
    default = forwards()
    assert all(torch.equal(a, b) for a, b in zip(engine, default))


def test_other_attention_implementations_are_left_alone():
    model, _ = build_tiny_model("llama")
    model.set_attn_implementation("eager")
    use_engine_attention(model)
    assert model.config._attn_implementation == "eager"



def masked_reference(query, key, value) -> torch.Tensor:
    """transformers' own SDPA attention over the lower-right causal mask it builds for rows after cached positions."""
    num_queries, num_keys = query.shape[2], key.shape[2]
    mask = torch.arange(num_keys)[None, :] <= torch.arange(num_keys - num_queries, num_keys)[:, None]  # [q, kv]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = query.shape[1] // key.shape[1], True
    return sdpa_attention.sdpa_attention_forward(module, query, key, value, mask[None, None])[0]


@pytest.mark.parametrize("num_heads, num_kv_heads, num_queries, num_keys", [(4, 2, 8, 40), (6, 3, 2, 300),
                                                                             (4, 4, 33, 34), (8, 1, 64, 2048)])
def test_live_causal_attention_is_the_masked_attention(num_heads, num_kv_heads, num_queries, num_keys):
    generator = torch.Generator().manual_seed(num_keys)
    query = torch.randn(1, num_heads, num_queries, 16, generator=generator)
    key, value = (torch.randn(1, num_kv_heads, num_keys, 16, generator=generator) for _ in range(2))
    got = live_causal_attention(query, key, value, None)
    assert got.shape == (1, num_queries, num_heads, 16)
    torch.testing.assert_close(got, masked_reference(query, key, value), rtol=1e-5, atol=1e-6)
    # Causal: changing the last live key and value moves the last row only, and the first row sees every cached key.
    key[:, :, -1] += 1
    value[:, :, -1] -= 1
    moved = live_causal_attention(query, key, value, None)
    assert torch.equal(moved[:, :-1], got[:, :-1]) and not torch.equal(moved[:, -1], got[:, -1])
    key[:, :, 0] += 1
    assert not torch.equal(live_causal_attention(query, key, value, None)[:, 0], moved[:, 0])


def test_a_prefill_after_cached_positions_builds_no_mask_and_keeps_model_generates_tokens(monkeypatch):
    model, tokenizer = build_tiny_model("llama")
    token_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected = plain_generate(model, token_ids, max_new_tokens=12)
    use_engine_attention(model)
    masks_built: list[tuple[int, int]] = []
    build_mask = ALL_MASK_ATTENTION_FUNCTIONS[ENGINE_ATTENTION]

    def counting_mask(*args, **kwargs):
        masks_built.append((kwargs["q_length"], kwargs["kv_length"]))
        return build_mask(*args, **kwargs)

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, ENGINE_ATTENTION, counting_mask)
    live_calls = []
    monkeypatch.setattr(attention, "live_causal_attention",
                        lambda *args: live_calls.append(args[0].shape[2]) or live_causal_attention(*args))
    cache = build_cache(model.config, *allocate_kv(kv_geometry(model.config), len(token_ids) + 12, "cpu",
                                                   torch.float32), 0)
    # The prompt in three pieces (as the step loop runs a long prompt, or a question after cached chunks), then decode.
    logits = None
    for begin, end in ((0, 40), (40, 72), (72, len(token_ids))):
        logits, _ = prefill(model, cache, torch.tensor(token_ids[begin:end]), begin)
    generated = [int(logits.argmax())]
    for position in range(len(token_ids), len(token_ids) + 11):
        generated.append(int(decode_alone(model, cache, torch.tensor(generated[-1]), position).argmax()))
    assert generated == expected
    assert live_calls == [32, 32, len(token_ids) - 72, len(token_ids) - 72]  # two layers, each piece after the first
    assert all(q_length == 1 or q_length == kv_length for q_length, kv_length in masks_built), masks_built


def test_live_causal_runs_only_where_it_is_exact_and_tested():
    model, _ = build_tiny_model("llama")
    ids = torch.tensor([1, 2, 3])
    assert live_causal_mask(model, ids, 5, False) is None  # transformers' SDPA: not the engine's attention yet
    use_engine_attention(model)
    assert live_causal_mask(model, ids, 5, False) is LIVE_CAUSAL
    assert live_causal_mask(model, ids, 0, False) is None  # nothing cached: SDPA's own causal mask is exact
    assert live_causal_mask(model, ids[:1], 5, False) is None  # one row sees every key: no mask is built anyway
    assert live_causal_mask(model, ids, 5, True) is None  # sliding-window layers need their window's mask
    assert live_causal_mask(model.to(torch.bfloat16), ids, 5, False) is None  # merging two bf16 halves rounds twice
