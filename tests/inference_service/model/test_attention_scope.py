"""The grouped-query SDPA flag is set only inside the engine's own forward passes, never for plain model calls."""
from __future__ import annotations

import os

import pytest
import torch
from transformers.integrations import sdpa_attention

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.model.attention_scope import FORCE_GQA_VARIABLE, engine_attention
from inference_service.store.memory import InMemoryStore

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2  # 90 byte tokens: several chunks of 8


@pytest.fixture()
def flag_at_each_sdpa_call(monkeypatch) -> list[str | None]:
    """The flag's value each time transformers decides how to run grouped-query SDPA (it reads it per call)."""
    seen: list[str | None] = []
    decide = sdpa_attention.use_gqa_in_sdpa

    def recording(*args, **kwargs):
        seen.append(os.environ.get(FORCE_GQA_VARIABLE))
        return decide(*args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", recording)
    return seen


def plain_generate(model, prompt_ids: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=4)
    return output[0, len(prompt_ids):].tolist()


def test_a_reference_computed_after_an_engine_exists_runs_without_the_flag(tiny_llama, flag_at_each_sdpa_call, monkeypatch):
    monkeypatch.delenv(FORCE_GQA_VARIABLE, raising=False)
    model, tokenizer = tiny_llama  # 4 query heads over 2 K/V heads: every layer asks for the flag
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="tiny")
    assert FORCE_GQA_VARIABLE not in os.environ, "building an Engine must not change the process environment"

    for _ in range(2):  # a miss, then a prefix hit whose masked suffix prefill is what the flag speeds up
        engine.generate(GenerationParams(prompt=PROMPT, max_new_tokens=4))
        engine.flush_writes()
    during_engine = list(flag_at_each_sdpa_call)
    flag_at_each_sdpa_call.clear()
    plain_generate(model, tokenizer(PROMPT, add_special_tokens=False)["input_ids"])

    assert during_engine and set(during_engine) == {"1"}, "the engine's forwards run with grouped-query SDPA on CPU"
    assert flag_at_each_sdpa_call and set(flag_at_each_sdpa_call) == {None}, "plain generate must see no flag"
    assert FORCE_GQA_VARIABLE not in os.environ


def test_an_explicit_setting_in_the_environment_wins(tiny_llama, flag_at_each_sdpa_call, monkeypatch):
    monkeypatch.setenv(FORCE_GQA_VARIABLE, "0")
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="tiny")

    engine.generate(GenerationParams(prompt=PROMPT, max_new_tokens=2))

    assert flag_at_each_sdpa_call and set(flag_at_each_sdpa_call) == {"0"}
    assert os.environ[FORCE_GQA_VARIABLE] == "0"


def test_overlapping_scopes_keep_the_flag_until_the_last_one_ends(monkeypatch):
    # Two engine threads: the first to finish must not take the flag from the one still running.
    monkeypatch.delenv(FORCE_GQA_VARIABLE, raising=False)
    cpu = torch.device("cpu")
    first, second = engine_attention(cpu), engine_attention(cpu)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert os.environ.get(FORCE_GQA_VARIABLE) == "1"
    second.__exit__(None, None, None)
    assert FORCE_GQA_VARIABLE not in os.environ


def test_cuda_forwards_keep_transformers_default(monkeypatch):
    monkeypatch.delenv(FORCE_GQA_VARIABLE, raising=False)
    with engine_attention(torch.device("cuda")):
        assert FORCE_GQA_VARIABLE not in os.environ


@pytest.mark.slow
def test_smollm2_reference_after_an_engine_runs_without_the_flag(smollm2, flag_at_each_sdpa_call, monkeypatch):
    # SmolLM2 groups 3 query heads per K/V head (the tiny model above: 2).
    monkeypatch.delenv(FORCE_GQA_VARIABLE, raising=False)
    model, tokenizer, path = smollm2
    assert model.config.num_attention_heads == 3 * model.config.num_key_value_heads
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=16), InMemoryStore(), model_id=path)
    for _ in range(2):
        engine.generate(GenerationParams(prompt=PROMPT, max_new_tokens=2))
        engine.flush_writes()
    during_engine = list(flag_at_each_sdpa_call)
    flag_at_each_sdpa_call.clear()
    plain_generate(model, tokenizer(PROMPT, add_special_tokens=False)["input_ids"])

    assert during_engine and set(during_engine) == {"1"}
    assert flag_at_each_sdpa_call and set(flag_at_each_sdpa_call) == {None}
