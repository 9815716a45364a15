"""A prompt prefilled in budgeted pieces, or beside others in one forward, decodes exactly as plain generate."""
from __future__ import annotations

import pytest

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from kvboost_keys.prompts import tokenize_prompt
from inference_service.store.memory import InMemoryStore
from tests.inference_service.engine.test_engine import reference_ids, text_of_length


@pytest.mark.parametrize("max_prefill_tokens", [7, 32, 4096])  # many pieces, a few, one
def test_pieces_of_any_size_give_the_answer_of_one_forward(tiny_llama, max_prefill_tokens):
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, max_prefill_tokens=max_prefill_tokens,
                                                   max_forward_tokens=max_prefill_tokens), InMemoryStore(), "tiny")
    pieces = []
    run_piece = engine.core.executor.run
    engine.core.executor.run = lambda plan: pieces.extend(n for _, n in plan.pieces) or run_piece(plan)
    busy = GenerationParams(prompt="keeps a row decoding", max_new_tokens=40)  # so the long prompt is cut
    long_prompt = text_of_length(100)
    outcomes = []
    engine.submit(busy, None, lambda: False, lambda result, error: outcomes.append(error or result))
    outcome = engine.generate(GenerationParams(prompt=long_prompt, max_new_tokens=8))
    assert outcome.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, long_prompt)[0], 8)
    if max_prefill_tokens == 7:
        assert len(pieces) > 5 and max(pieces) <= 128  # at least a forward's worth per step, never starved
    engine.stop()


def test_a_warm_up_prefills_in_pieces_and_stores_everything(tiny_llama):
    model, tokenizer = tiny_llama
    store = InMemoryStore()
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, max_prefill_tokens=16, max_forward_tokens=16),
                    store, "tiny")
    warmed = engine.warm(text_of_length(83))
    assert (warmed.chunks_stored, warmed.token_count, warmed.partial_tail_tokens) == (10 + 1, 83, 3)
    again = engine.generate(GenerationParams(prompt=text_of_length(83) + " and then?", max_new_tokens=4))
    assert again.cached_tokens == 83
    engine.stop()
