"""n > 1: one prefill of the prompt, rows decoded together, each choice streamed with its index."""
from __future__ import annotations

import pytest

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.store.memory import InMemoryStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
# 90 byte tokens: 11 chunks of 8 and a stored 2-token partial tail, so a repeat reuses every token but the last
# (always recomputed for its logits).


def make_engine(model_and_tokenizer) -> Engine:
    model, tokenizer = model_and_tokenizer
    return Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="tiny")


def count_prefills(model) -> list[int]:
    """Records the token count of every forward that runs more than one token per row (a prefill)."""
    lengths = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1])
        if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    return lengths


def test_greedy_choices_equal_the_single_request_and_share_one_prefill(tiny_model_fresh):
    engine = make_engine(tiny_model_fresh)
    single = engine.generate(GenerationParams(prompt=PROMPT, max_new_tokens=8, mode="baseline"))
    prefills = count_prefills(tiny_model_fresh[0])
    events = []

    outcomes = engine.generate_choices(GenerationParams(prompt=PROMPT, max_new_tokens=8, mode="baseline", n=3),
                                       on_token=events.append)

    assert prefills == [len(PROMPT)]  # the prompt ran once for the three choices
    assert [outcome.index for outcome in outcomes] == [0, 1, 2]
    assert all(outcome.output_token_ids == single.output_token_ids for outcome in outcomes)
    for index, outcome in enumerate(outcomes):
        mine = [event for event in events if event.index == index]
        assert [t for event in mine for t in event.token_ids] == outcome.output_token_ids
        assert "".join(event.text for event in mine) == outcome.output_text
        assert outcome.prompt_tokens == len(PROMPT)


def test_seeded_choices_differ_from_each_other_and_repeat(tiny_llama):
    engine = make_engine(tiny_llama)
    params = GenerationParams(prompt=PROMPT, max_new_tokens=10, temperature=1.5, seed=7, n=3, mode="baseline")
    first = [outcome.output_token_ids for outcome in engine.generate_choices(params)]
    again = [outcome.output_token_ids for outcome in engine.generate_choices(params)]
    assert first == again
    assert len({tuple(ids) for ids in first}) == 3
    # Choice 0 is what a single request with the same seed samples.
    single = engine.generate(GenerationParams(prompt=PROMPT, max_new_tokens=10, temperature=1.5, seed=7,
                                              mode="baseline"))
    assert first[0] == single.output_token_ids


def test_the_largest_seed_wraps_for_the_next_choice(tiny_llama):
    """Seeds are unsigned 64-bit: choice 1 of seed 2**64 - 1 samples with seed 0 (the gateway sends seed -1 as it)."""
    engine = make_engine(tiny_llama)
    params = GenerationParams(prompt=PROMPT, max_new_tokens=10, temperature=1.5, seed=2**64 - 1, n=2, mode="baseline")
    choices = engine.generate_choices(params)
    assert [outcome.finish_reason for outcome in choices] == ["length", "length"]
    seed_zero = engine.generate(GenerationParams(prompt=PROMPT, max_new_tokens=10, temperature=1.5, seed=0,
                                                 mode="baseline"))
    assert choices[1].output_token_ids == seed_zero.output_token_ids


def test_choices_reuse_the_cached_prefix_and_count_as_one_request(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.generate(GenerationParams(prompt=PROMPT, max_new_tokens=2, mode="prefix_cache"))
    engine.flush_writes()
    before = engine.stats()["requests"]
    outcomes = engine.generate_choices(GenerationParams(prompt=PROMPT, max_new_tokens=4, mode="prefix_cache", n=2,
                                                        logprobs=1))
    assert [outcome.cached_tokens for outcome in outcomes] == [len(PROMPT) - 1] * 2
    assert engine.stats()["requests"] == before + 1


def test_choices_finish_on_their_own(tiny_llama):
    # Different stop reasons per row: row lengths differ, finished rows leave the batch.
    engine = make_engine(tiny_llama)
    params = GenerationParams(prompt=PROMPT, max_new_tokens=12, temperature=2.0, seed=3, n=4, mode="baseline",
                              stop_token_ids=tuple(range(0, 260, 3)))
    outcomes = engine.generate_choices(params)
    for outcome in outcomes:
        assert outcome.finish_reason in ("stop", "length")
        assert outcome.generated_tokens == len(outcome.output_token_ids) >= 1


def test_sliding_window_models_run_choices_one_after_another():
    from tests.factories import build_tiny_model

    engine = make_engine(build_tiny_model("mistral_sliding"))
    single = engine.generate(GenerationParams(prompt=PROMPT, max_new_tokens=5, mode="baseline"))
    outcomes = engine.generate_choices(GenerationParams(prompt=PROMPT, max_new_tokens=5, mode="baseline", n=2))
    assert [outcome.index for outcome in outcomes] == [0, 1]
    assert all(outcome.output_token_ids == single.output_token_ids for outcome in outcomes)


@pytest.fixture()
def tiny_model_fresh():
    """A tiny Llama of its own (the test adds a forward hook)."""
    from tests.factories import build_tiny_model

    return build_tiny_model("llama")
