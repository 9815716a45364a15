"""The load-or-recompute choice in the engine: a run loaded whole, in part (L0's head, the store's rest recomputed) or
not at all gives plain model.generate's tokens in fp32, and a run cut before the store's chunks fetches nothing."""
from __future__ import annotations

import pytest
import torch

from inference_service.engine.engine import GenerationParams
from inference_service.reuse.load_choice import LoadChooser
from inference_service.store.memory import InMemoryStore
from kvboost_keys.prompts import tokenize_prompt
from tests.inference_service.engine.test_engine import make_engine, reference_ids, run, text_of_length

SLOW = (1.0, 1e-12)  # a load's fixed seconds and seconds a byte: 1 s whatever the size
FAST = (0.0, 1e-12)


def chooser_with(l0: tuple[float, float], store: tuple[float, float]) -> LoadChooser:
    """Prefill 100 us a token; L0 and the store as given (seeded: no request needs to have measured them)."""
    chooser = LoadChooser()
    chooser.prefill.seed([(8, 0.0008), (64, 0.0064)])
    for tier, (fixed, per_byte) in (("l0", l0), ("store", store)):
        chooser.load_meter(tier).seed([(n, fixed + n * per_byte) for n in (4096, 32768)])
    return chooser


@pytest.mark.parametrize("l0, store, cached, skipped", [
    (FAST, FAST, 71, 0),  # all loaded: the last token runs again for its logits
    (FAST, SLOW, 32, 40),  # L0's head (4 chunks) loaded, the store's 5 chunks recomputed: never fetched
    (SLOW, SLOW, 0, 72),  # all recomputed
])
def test_a_run_loaded_whole_in_part_or_not_at_all_gives_model_generates_tokens(tiny_llama, l0, store, cached,
                                                                               skipped):
    shared = InMemoryStore()
    writer = make_engine(tiny_llama, cache=shared)
    reader = make_engine(tiny_llama, cache=shared, recompute_when_faster=True)
    try:
        head, prompt = text_of_length(32), text_of_length(72)  # 4 and 9 chunks of 8 tokens, the first 4 shared
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        run(writer, prompt=prompt)  # the store holds the 9 chunks
        run(reader, prompt=head)  # the reader's L0 holds the first 4 (fetched or recomputed, then kept)
        reader.parts.counters.chooser = chooser_with(l0, store)
        before = reader.stats()
        answer = run(reader, prompt=prompt)
        after = reader.stats()
        assert answer.output_token_ids == expected
        assert answer.cached_tokens == cached
        assert (after["loads_skipped"] - before["loads_skipped"],
                after["load_skipped_tokens"] - before["load_skipped_tokens"]) == (int(skipped > 0), skipped)
        # Below break-even the store is asked for no bytes.
        assert after["chunks_fetched"] - before["chunks_fetched"] == (5 if cached == 71 else 0)
    finally:
        writer.close()
        reader.close()


def test_l0_asked_before_the_choice_still_answers_only_what_the_daemons_lookup_confirms(tiny_llama):
    store = InMemoryStore()
    engine = make_engine(tiny_llama, cache=store, recompute_when_faster=True)  # L0 on, the choice on
    try:
        prompt = text_of_length(40)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        run(engine, prompt=prompt)
        engine.parts.counters.chooser = chooser_with(FAST, FAST)
        assert run(engine, prompt=prompt).cached_tokens == 39  # from L0
        hits = engine.stats()["l0_chunks_hit"]
        plan = engine.plan_request(GenerationParams(prompt=prompt))[1]
        store.delete(list(plan.prefix_keys))  # as the daemon's Delete (or a namespace drop) would
        answer = run(engine, prompt=prompt)
        assert answer.output_token_ids == expected
        assert engine.stats()["l0_chunks_hit"] == hits  # held, but the daemon's Lookup said no
        assert answer.cached_tokens < 8  # nothing whole was reused
    finally:
        engine.close()


@pytest.fixture(scope="module")
def bf16_model():
    from tests.inference_service.engine.test_invariant_prefill import random_bf16_llama
    return random_bf16_llama(256, 768, 2, 4, 2)


def test_with_invariant_prefill_the_choice_keeps_bf16_answers_bitwise(bf16_model):
    """The invariant path's promise (a cached prompt is bitwise its uncached self) holds for a run loaded whole, in
    part or not at all. On the 2-core dev CPU the default path happened to agree bitwise too for this prompt (checked
    by hand), so this shows the promise kept, not the default path failing it (test_invariant_prefill.py does)."""
    from bench.gpu_model import words
    from inference_service.engine.engine import Engine, EngineConfig

    def engine(store, **config):
        return Engine(*bf16_model, EngineConfig(chunk_size=32, max_prompt_tokens=1024, invariant_prefill=True,
                                                **config), store, model_id="bf16-random")

    head = words(128, seed=5, vocab_size=1024)  # 4 chunks of 32
    prompt = head + " " + words(160, seed=6, vocab_size=1024)  # 9 chunks, the first 4 shared
    answers = {}
    uncached = engine(InMemoryStore())
    try:
        answers["uncached"] = first_logits(uncached, prompt, "baseline")
    finally:
        uncached.close()
    for name, l0, store_cost in (("all", FAST, FAST), ("prefix", FAST, SLOW), ("none", SLOW, SLOW)):
        shared = InMemoryStore()
        writer, reader = engine(shared), engine(shared, recompute_when_faster=True)
        try:
            run(writer, prompt=prompt)
            run(reader, prompt=head)
            reader.parts.counters.chooser = chooser_with(l0, store_cost)
            answers[name] = first_logits(reader, prompt)
            assert answers[name][0] == {"all": 256, "prefix": 128, "none": 0}[name]  # from a chunk boundary
        finally:
            writer.close()
            reader.close()
    _, tokens, logits = answers["uncached"]
    for name in ("all", "prefix", "none"):  # bitwise: the first token's logits equal, every token the same
        assert answers[name][1] == tokens and torch.equal(answers[name][2], logits), name


def first_logits(engine, prompt: str, mode: str | None = None):
    """(cached tokens, output token ids, the first token's logits) of one greedy request."""
    outcome, logits = engine.generate_with_first_logits(GenerationParams(prompt=prompt, max_new_tokens=8, mode=mode))
    engine.flush_writes()
    return outcome.cached_tokens, outcome.output_token_ids, logits
