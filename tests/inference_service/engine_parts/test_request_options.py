"""Request options the HTTP gateway needs: logprobs, prompt logprobs, min_tokens, ignore_eos, stop_token_ids,
cache_salt, tokenize/detokenize — on the tiny seeded Llama against plain model forwards."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.errors import InvalidRequest
from inference_service.store.memory import InMemoryStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
# 90 byte tokens: 11 chunks of 8 and a stored 2-token partial tail, so a repeat reuses every token but the last
# (always recomputed for its logits).


def make_engine(tiny_llama, store=None) -> Engine:
    model, tokenizer = tiny_llama
    return Engine(model, tokenizer, EngineConfig(chunk_size=8), store or InMemoryStore(), model_id="tiny")


def generate(engine: Engine, **fields):
    """(outcome, streamed events)."""
    events = []
    fields.setdefault("prompt", PROMPT)
    fields.setdefault("max_new_tokens", 6)
    outcome = engine.generate(GenerationParams(**fields), on_token=events.append)
    engine.flush_writes()
    return outcome, events


def full_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[tokens, vocab] float32 log-softmax of one plain forward over the whole sequence."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_of_generated_tokens_match_a_plain_forward(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama)
    outcome, events = generate(engine, logprobs=3, mode="baseline")

    streamed = [item for event in events for item in event.logprobs]
    assert [item.token_id for item in streamed] == outcome.output_token_ids
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    reference = full_logits(model, prompt_ids + outcome.output_token_ids)
    for step, item in enumerate(streamed):
        row = reference[len(prompt_ids) + step - 1]
        assert item.logprob == pytest.approx(row[item.token_id].item(), abs=1e-4)
        # Greedy: the chosen token is the best alternative; three alternatives, best first.
        assert [alt.token_id for alt in item.top] == torch.topk(row, 3).indices.tolist()
        assert item.top[0].token_id == item.token_id
        assert item.text == tokenizer.decode([item.token_id])


def test_no_logprobs_unless_asked(tiny_llama):
    _, events = generate(make_engine(tiny_llama))
    assert all(event.logprobs == () and event.prompt_logprobs == () for event in events)


def test_prompt_logprobs_match_a_plain_forward_and_still_store_chunks(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama)
    outcome, events = generate(engine, prompt_logprobs=2, mode="prefix_cache")

    scored = events[0].prompt_logprobs  # sent once, first
    assert all(event.prompt_logprobs == () for event in events[1:])
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert [item.token_id for item in scored] == prompt_ids
    assert scored[0].logprob is None and scored[0].top == ()
    reference = full_logits(model, prompt_ids)
    assert [item.logprob for item in scored[1:]] == pytest.approx(
        [reference[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))], abs=1e-4)
    assert outcome.cached_tokens == 0
    # The chunks were stored: a plain request now reuses them.
    again, _ = generate(engine, mode="prefix_cache")
    assert again.cached_tokens == len(prompt_ids) - 1
    assert again.output_token_ids == outcome.output_token_ids


def test_min_tokens_holds_off_eos_and_ignore_eos_runs_past_it(tiny_llama):
    engine = make_engine(tiny_llama)
    free, _ = generate(engine, max_new_tokens=12, mode="baseline")
    eos = free.output_token_ids[2]
    engine.parts = dataclasses.replace(engine.parts, eos_ids=frozenset({eos}))

    stopped, _ = generate(engine, max_new_tokens=12, mode="baseline")
    assert stopped.finish_reason == "eos" and stopped.generated_tokens == free.output_token_ids.index(eos) + 1

    held, _ = generate(engine, max_new_tokens=12, mode="baseline", min_tokens=8)
    assert held.generated_tokens >= 8 and eos not in held.output_token_ids[:8]

    ignored, _ = generate(engine, max_new_tokens=12, mode="baseline", ignore_eos=True)
    assert ignored.finish_reason == "length" and ignored.output_token_ids == free.output_token_ids


def test_stop_token_ids_end_generation_with_reason_stop(tiny_llama):
    engine = make_engine(tiny_llama)
    free, _ = generate(engine, max_new_tokens=12, mode="baseline")
    stop_id = free.output_token_ids[4]
    outcome, _ = generate(engine, max_new_tokens=12, mode="baseline", stop_token_ids=(stop_id,))
    assert outcome.finish_reason == "stop"
    assert outcome.output_token_ids == free.output_token_ids[: free.output_token_ids.index(stop_id) + 1]


def test_cache_salt_isolates_cached_chunks(tiny_llama):
    engine = make_engine(tiny_llama)
    generate(engine, mode="prefix_cache")  # stores the prompt's chunks under the plain namespace
    num_chunk_tokens = len(PROMPT) - 1

    first_salted, _ = generate(engine, mode="prefix_cache", cache_salt="tenant-a")
    second_salted, _ = generate(engine, mode="prefix_cache", cache_salt="tenant-a")
    other_salt, _ = generate(engine, mode="prefix_cache", cache_salt="tenant-b")
    plain, _ = generate(engine, mode="prefix_cache")

    assert first_salted.cached_tokens == 0  # the plain chunks are not visible under a salt
    assert second_salted.cached_tokens == num_chunk_tokens  # the same salt hits its own
    assert other_salt.cached_tokens == 0
    assert plain.cached_tokens == num_chunk_tokens
    assert first_salted.output_token_ids == second_salted.output_token_ids == plain.output_token_ids


def test_warm_under_a_salt_is_found_by_that_salt_only(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.warm(PROMPT, cache_salt="tenant-a")
    salted, _ = generate(engine, mode="prefix_cache", cache_salt="tenant-a")
    plain, _ = generate(engine, mode="prefix_cache")
    assert salted.cached_tokens == len(PROMPT) - 1 and plain.cached_tokens == 0


def test_tokenize_counts_as_generate_does_and_detokenize_inverts_it(tiny_llama):
    engine = make_engine(tiny_llama)
    token_ids, tokens = engine.tokenize(prompt="Hi there")
    outcome, _ = generate(engine, prompt="Hi there", max_new_tokens=1)
    assert len(token_ids) == outcome.prompt_tokens and tokens == list("Hi there")
    assert engine.detokenize(token_ids) == "Hi there"

    chat_ids, _ = engine.tokenize(messages=(("user", "Hi"),))
    chat, _ = generate(engine, prompt=None, messages=(("user", "Hi"),), max_new_tokens=1)
    assert len(chat_ids) == chat.prompt_tokens
    without_prompt, _ = engine.tokenize(messages=(("user", "Hi"),), add_generation_prompt=False)
    assert len(without_prompt) < len(chat_ids)


@pytest.mark.parametrize("call", [
    lambda engine: engine.tokenize(),
    lambda engine: engine.tokenize(prompt="a", messages=(("user", "b"),)),
    lambda engine: engine.tokenize(messages=(("wizard", "b"),)),
    lambda engine: engine.detokenize([10 ** 6]),
])
def test_tokenize_and_detokenize_refuse_bad_input(tiny_llama, call):
    with pytest.raises(InvalidRequest):
        call(make_engine(tiny_llama))


@pytest.mark.parametrize("fields", [dict(n=0), dict(n=17), dict(logprobs=21), dict(prompt_logprobs=-1),
                                    dict(min_tokens=7, max_new_tokens=6), dict(stop_token_ids=(-1,))])
def test_out_of_range_options_are_invalid(fields):
    with pytest.raises(InvalidRequest):
        GenerationParams(prompt="x", **{"max_new_tokens": 6, **fields})


def test_the_smallest_temperature_is_accepted_as_the_proto_carries_it():
    """The proto's float32 nearest 1e-6 lies just below 1e-6: it is the smallest temperature, not a refusal."""
    import struct

    from inference_service.errors import InvalidRequest
    from inference_service.engine_parts.types import MIN_TEMPERATURE, GenerationParams

    as_float32 = struct.unpack("<f", struct.pack("<f", MIN_TEMPERATURE))[0]
    assert as_float32 < MIN_TEMPERATURE
    for temperature in (as_float32, MIN_TEMPERATURE, 0.0, 0.5):
        GenerationParams(prompt="hi", temperature=temperature)  # checked on construction
    with pytest.raises(InvalidRequest, match="at least 1e-06"):
        GenerationParams(prompt="hi", temperature=as_float32 / 2)
