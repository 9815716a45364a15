"""The engine's attention: a registered implementation chosen per call, bit-identical to transformers' own SDPA,
and never taken by a plain model call, even one running beside the engine's forwards."""
from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from transformers.integrations import sdpa_attention

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.model import attention
from inference_service.model.attention import ENGINE_ATTENTION, use_engine_attention
from inference_service.model import forward as forward_module
from inference_service.model.forward import decode_alone, prefill
from inference_service.model.kv_buffers import allocate_kv, build_cache, kv_geometry
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

