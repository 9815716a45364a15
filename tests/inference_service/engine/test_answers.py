"""A request's answer is written back with its prompt: the next turn recomputes only what is new, exactly."""
from __future__ import annotations

import pytest

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from kvboost_keys.prompts import tokenize_prompt
from inference_service.store.memory import InMemoryStore
from tests.inference_service.engine.test_engine import reference_ids, text_of_length

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def generate_ids(engine: Engine, token_ids: list[int], max_new_tokens: int, mode: str = "prefix_cache"):
    """A request of these exact prompt tokens (a random model's answer need not decode to text that tokenizes back
    to the same ids), run through the engine's step loop like any request."""
    from inference_service.engine.engine import _wait
    from inference_service.engine.request import EngineRequest
    from inference_service.engine_parts.planning import plan_segments

    params = GenerationParams(prompt="(token ids)", max_new_tokens=max_new_tokens, mode=mode)
    prompt = plan_segments(engine.parts, [token_ids])
    return _wait(lambda on_done: engine.core.submit([EngineRequest(params, None, lambda: False, on_done, engine.parts, mode,
                                                              prompt, max_new_tokens)]))[0]


def make(tiny_llama, **config) -> Engine:
    model, tokenizer = tiny_llama
    return Engine(model, tokenizer, EngineConfig(chunk_size=8, **config), InMemoryStore(), model_id="tiny")


@pytest.mark.parametrize("answer_tokens", [5, 30])  # the answer ends inside the tail's chunk, and chunks later
def test_the_next_turn_reuses_the_whole_previous_turn_and_stays_identical(tiny_llama, answer_tokens):
    model, tokenizer = tiny_llama
    engine = make(tiny_llama)
    first_prompt = text_of_length(37)  # 4 whole chunks and a 5-token tail
    first = engine.generate(GenerationParams(prompt=first_prompt, max_new_tokens=answer_tokens))
    engine.flush_writes()
    # The next turn: the first prompt, the answer (all of it whose K/V were computed: every token but the
    # last) and a new message.
    answer_ids = first.output_token_ids[:-1]
    next_ids = tokenize_prompt(tokenizer, first_prompt)[0] + answer_ids + list(b" Next?")
    second = generate_ids(engine, next_ids, 8)
    assert second.cached_tokens == 37 + len(answer_ids)  # only " Next?" recomputed
    assert second.output_token_ids == reference_ids(model, next_ids, 8)
    engine.stop()


def test_stored_answers_are_bounded_and_can_be_turned_off(tiny_llama):
    model, tokenizer = tiny_llama
    for limit, expected_cached in ((0, 37), (9, 46)):
        engine = make(tiny_llama, max_answer_tokens_stored=limit)
        first_prompt = text_of_length(37)
        first = engine.generate(GenerationParams(prompt=first_prompt, max_new_tokens=20))
        engine.flush_writes()
        next_ids = tokenize_prompt(tokenizer, first_prompt)[0] + first.output_token_ids[:-1] + list(b" Next?")
        second = generate_ids(engine, next_ids, 4)
        # limit 0: the prompt alone (its tail's partial chunk included); limit 9: the whole chunks that 37 + 9
        # tokens hold (40) and the 6 after them as a partial chunk, 46 in all.
        assert second.cached_tokens == expected_cached, limit
        assert second.output_token_ids == reference_ids(model, next_ids, 4)
        engine.stop()


def test_a_baseline_request_stores_no_answer(tiny_llama):
    engine = make(tiny_llama)
    engine.generate(GenerationParams(prompt=text_of_length(37), max_new_tokens=20, mode="baseline"))
    engine.flush_writes()
    assert len(engine.store._entries) == 0
    engine.stop()


@pytest.mark.slow
def test_smollm2_chat_turns_recompute_only_their_new_message(smollm2):
    model, tokenizer, path = smollm2
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=32), InMemoryStore(), model_id=path)
    messages = [("system", "You are a concise assistant for a bakery. Answer in one sentence."),
                ("user", "What bread is best for sandwiches?")]
    from kvboost_keys.prompts import tokenize_messages
    previous_prompt_tokens = previous_answer_tokens = 0  # the turn before's, read from the second turn on
    for turn, question in enumerate(["And for toast?", "Which one keeps longest?", "Thanks, bye."]):
        prompt_ids = tokenize_messages(tokenizer, messages)[0]
        outcome = engine.generate(GenerationParams(messages=tuple(messages), max_new_tokens=24, mode="prefix_cache"))
        engine.flush_writes()
        assert outcome.output_token_ids == reference_ids(model, prompt_ids, 24)
        if turn:
            # Everything of the previous turn was stored: its prompt and its answer (but the answer's last token).
            assert outcome.cached_tokens >= previous_prompt_tokens + previous_answer_tokens - 1, turn
        previous_prompt_tokens, previous_answer_tokens = len(prompt_ids), outcome.generated_tokens
        messages += [("assistant", outcome.output_text), ("user", question)]
    engine.stop()
