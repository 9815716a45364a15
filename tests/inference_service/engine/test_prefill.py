"""A prompt prefilled in budgeted pieces, or beside others in one forward, decodes exactly as plain generate."""
from __future__ import annotations

import threading

import pytest

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from kvboost_keys.prompts import tokenize_prompt
from inference_service.store.memory import InMemoryStore
from tests.conftest import wait_for
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


class ForwardSpy:
    """Counts the prefill forwards (alone and batched) and records each decode forward's rows {slot: position}."""

    def __init__(self, engine, monkeypatch) -> None:
        from inference_service.engine import prefill

        self.prefills, self.steps = 0, []
        for name in ("prefill", "prefill_rows"):
            real = getattr(prefill, name)
            monkeypatch.setattr(prefill, name, self._counted(real))
        runner = engine.core.executor.runner
        decode = runner.decode
        monkeypatch.setattr(runner, "decode", lambda rows: self.steps.append(
            {slot: position for slot, (_, position) in rows.items()}) or decode(rows))

    def _counted(self, real):
        def counted(*args, **kwargs):
            self.prefills += 1
            return real(*args, **kwargs)
        return counted


def test_a_prompt_cached_to_its_last_token_runs_it_beside_the_decoding_rows(tiny_llama, monkeypatch):
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), "tiny")
    try:
        prompt = text_of_length(61)
        first = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=8))
        engine.flush_writes(30)
        spy = ForwardSpy(engine, monkeypatch)
        busy, stop_busy = [], threading.Event()  # a row that decodes (no EOS) until the test stops it
        engine.submit(GenerationParams(prompt="keeps a row decoding", max_new_tokens=4000, min_tokens=4000), None,
                      stop_busy.is_set, lambda result, error: busy.append(error or result))
        wait_for(lambda: spy.steps, "the busy request to decode")
        num_prefills = spy.prefills
        again = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=8))
        assert not busy, "the busy row ended before the cached prompt ran"
        stop_busy.set()
        wait_for(lambda: busy, "the busy request to end")
    finally:
        stop_busy.set()
        engine.stop()
    expected = reference_ids(model, tokenize_prompt(tokenizer, prompt)[0], 8)
    assert first.output_token_ids == again.output_token_ids == expected
    assert again.cached_tokens == again.prompt_tokens - 1 == 60
    assert spy.prefills == num_prefills  # no forward of its own: its last token ran in a decode step ...
    assert any(len(rows) == 2 and 60 in rows.values() for rows in spy.steps)  # ... beside the busy row


def test_prompts_cached_to_their_last_token_that_arrive_while_a_step_places_others_join_it(tiny_llama, monkeypatch):
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), "tiny")
    prompts = [text_of_length(45), "Another document, " + text_of_length(40)]
    try:
        for prompt in prompts:
            engine.generate(GenerationParams(prompt=prompt, max_new_tokens=1))
        engine.flush_writes(30)
        spy = ForwardSpy(engine, monkeypatch)
        outcomes: list = [None, None]

        def ask(index: int) -> None:
            engine.submit(GenerationParams(prompt=prompts[index], max_new_tokens=6), None, lambda: False,
                          lambda result, error: outcomes.__setitem__(index, error or result[0]))

        start = engine.core.executor.start

        def start_and_let_the_second_arrive(seq) -> None:  # the second request arrives while the first is placed
            start(seq)
            if outcomes[1] is None and len(engine.core.executor.sequences) == 1:
                ask(1)

        monkeypatch.setattr(engine.core.executor, "start", start_and_let_the_second_arrive)
        ask(0)
        wait_for(lambda: all(outcomes), "both answers")
    finally:
        engine.stop()
    for prompt, outcome in zip(prompts, outcomes):
        assert outcome.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, prompt)[0], 6)
        assert outcome.cached_tokens == outcome.prompt_tokens - 1
    assert spy.prefills == 0
    assert sorted(spy.steps[0].values()) == [44, len(tokenize_prompt(tokenizer, prompts[1])[0]) - 1]  # one forward
