"""L0 in the engine: a repeated prefix is placed from the service's own memory, not fetched, and the answer is
still model.generate's; chunks fetched from the store join L0 after the first token; quantized storage has none."""
from __future__ import annotations

import pytest

from inference_service.engine.engine import GenerationParams
from inference_service.store.memory import InMemoryStore
from kvboost_keys.prompts import tokenize_prompt
from tests.inference_service.engine.test_engine import make_engine, reference_ids, run, text_of_length
from tests.inference_service.engine.test_hold_for_write_back import GatedStore


@pytest.mark.parametrize("num_tokens", [33, 70])
def test_a_repeated_prompt_is_placed_from_l0_and_stays_exact(tiny_model, num_tokens):
    model, tokenizer = tiny_model
    engine = make_engine(tiny_model, chunk_size=8)
    try:
        prompt = text_of_length(num_tokens)
        expected = reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])
        first = run(engine, prompt=prompt)
        fetched = engine.stats()["chunks_fetched"]
        second = run(engine, prompt=prompt)
        stats = engine.stats()
        assert first.output_token_ids == second.output_token_ids == expected
        assert second.cached_tokens == num_tokens - 1
        assert stats["l0_chunks_hit"] == num_tokens // 8 + 1  # every whole chunk and the tail from L0 ...
        assert stats["chunks_fetched"] == fetched  # ... nothing from the store
    finally:
        engine.close()


def test_chunks_fetched_from_the_store_join_l0_after_the_first_token(tiny_llama):
    store = InMemoryStore()
    writer = make_engine(tiny_llama, cache=store)
    reader = make_engine(tiny_llama, cache=store)  # another process sharing the daemon: its L0 starts empty
    try:
        prompt = text_of_length(64)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        run(writer, prompt=prompt)
        from_store = run(reader, prompt=prompt)
        assert reader.stats()["l0_chunks_hit"] == 0 and reader.stats()["chunks_fetched"] > 0
        from_l0 = run(reader, prompt=prompt)
        assert reader.stats()["l0_chunks_hit"] == 8  # all 8 whole chunks placed; the last token runs again
        assert from_store.output_token_ids == from_l0.output_token_ids == expected
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("num_tokens", [64, 70])  # 70: a tail after the whole chunks, placed from L0 too
def test_chunks_the_daemon_evicted_are_placed_from_l0_until_a_delete_reaches_it(tiny_llama, num_tokens):
    """The daemon's budget evicting a prompt's chunks does not make L0 recompute what it holds, nor ask the daemon
    again on the step loop; a Delete at the daemon (of anything: L0 cannot tell what) does recompute, until the
    daemon confirms a chunk again."""
    store = InMemoryStore()
    engine = make_engine(tiny_llama, cache=store)
    try:
        prompt = text_of_length(num_tokens)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        run(engine, prompt=prompt)
        assert run(engine, prompt=prompt).cached_tokens == num_tokens - 1  # the daemon's Lookup confirmed them all
        plan = engine.plan_request(GenerationParams(prompt=prompt))[1]
        store.evict([*plan.prefix_keys, *([plan.tail_key] if plan.tail_key else [])])  # the budget: no Delete
        before = engine.stats()
        evicted = run(engine, prompt=prompt)
        stats = engine.stats()
        assert evicted.output_token_ids == expected and evicted.cached_tokens == num_tokens - 1
        assert stats["l0_chunks_alone"] == 8 and stats["chunks_fetched"] == before["chunks_fetched"]
        assert stats["step_loop_lookups"] == before["step_loop_lookups"]
        store.delete([b"\0" * 32])  # a Delete of another key: L0 no longer answers alone
        deleted = run(engine, prompt=prompt)
        assert deleted.output_token_ids == expected and deleted.cached_tokens < 8
        assert engine.stats()["l0_chunks_alone"] == 8
    finally:
        engine.close()


def test_a_small_l0_evicts_and_answers_stay_exact(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=8, l0_bytes=3 * 8 * 512)  # three 8-token chunks of 512 B/token
    try:
        prompts = [text_of_length(40), "Another text entirely, forty tokens long!"]
        for prompt in prompts + prompts:
            expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
            assert run(engine, prompt=prompt).output_token_ids == expected
        assert engine.stats()["l0_bytes_held"] <= 3 * 8 * 512 and engine.stats()["l0_chunks_evicted"] > 0
    finally:
        engine.close()


def test_quantized_storage_keeps_no_l0(tiny_llama):
    engine = make_engine(tiny_llama, kv_cache_bits=8)
    try:
        assert engine.parts.l0 is None and "l0_chunks_hit" not in engine.stats()
    finally:
        engine.close()


def held(store: InMemoryStore, keys: list[bytes]) -> list[bool]:
    return [blob is not None for _, blob in store.fetch(keys)]


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def tiny_model(request):
    return request.getfixturevalue(request.param)


@pytest.fixture()
def gated(tiny_llama):
    """(a store whose Stores wait for its gate, an engine on it): write-backs stay in flight until the test opens it."""
    store = GatedStore()
    engine = make_engine(tiny_llama, cache=store)
    try:
        yield store, engine
    finally:
        store.gate.set()
        engine.close()


def test_a_prompt_asked_again_while_its_write_back_is_in_flight_is_placed_from_l0_at_once(tiny_llama, gated):
    store, engine = gated
    prompt = text_of_length(45)  # 5 whole chunks and a 5-token tail
    expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
    first = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=12))
    assert len(store) == 0  # the first request's write-back is still waiting on the daemon
    again = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=12))  # not held for it
    assert again.cached_tokens == 44 and len(store) == 0
    assert first.output_token_ids == again.output_token_ids == expected
    assert engine.stats()["l0_chunks_hit"] == 6 and engine.stats()["chunks_fetched"] == 0  # 5 whole + the tail


def test_a_delete_while_a_write_back_is_in_flight_keeps_its_chunks_out_of_the_store_and_of_l0(tiny_llama, gated):
    """The write-back carries its Lookup's delete epoch: a Delete of its chunks that ends before its Store arrives
    keeps them out of the store, and L0, which added them at that epoch, stops answering for them alone."""
    store, engine = gated
    prompt = text_of_length(45)  # 5 whole chunks and a 5-token tail
    expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
    first = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=12))
    plan = engine.plan_request(GenerationParams(prompt=prompt))[1]
    keys = [*plan.prefix_keys, plan.tail_key]
    store.delete(keys)  # the user deletes the prompt's chunks while its write-back waits on the daemon
    store.gate.set()
    engine.flush_writes()
    assert held(store, keys) == [False] * 6  # not stored again after the Delete
    again = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=12))
    assert first.output_token_ids == again.output_token_ids == expected
    assert again.cached_tokens == 0 and engine.stats()["l0_chunks_alone"] == 0
    engine.flush_writes()
    assert held(store, keys) == [True] * 6  # the new write-back saw the Delete: stored


def test_a_batch_followers_write_back_carries_the_epoch_of_the_lookup_it_shared(tiny_llama, gated):
    """Two prompts sharing a prefix in one batch: the second takes the first's K/V without a Lookup of its own, and
    its chunks' write-back carries the first's delete epoch, so a Delete after it keeps them out too."""
    store, engine = gated
    base = text_of_length(40)
    prompts = [base + " alpha beta gamma delta epsilon zeta", base + " one two three four five six seven"]
    engine.generate_batch([GenerationParams(prompt=prompt, max_new_tokens=2) for prompt in prompts])
    plans = [engine.plan_request(GenerationParams(prompt=prompt))[1] for prompt in prompts]
    own = [key for key in plans[1].prefix_keys if key not in plans[0].prefix_keys] + [plans[1].tail_key]
    assert own and len(store) == 0  # the follower's own chunks, all still on their way
    store.delete(own)
    store.gate.set()
    engine.flush_writes()
    assert held(store, own) == [False] * len(own)
    assert all(held(store, list(plans[0].prefix_keys)))  # the first prompt's, not named, are stored


def test_a_prompt_longer_than_l0_is_served_from_its_first_chunk_as_far_as_l0_holds_it(tiny_llama):
    """Least-recently-used eviction dropped such a prompt's head (its oldest chunks) and then placed nothing from L0;
    leaf-first eviction keeps the head, and the rest comes from the store."""
    engine = make_engine(tiny_llama, chunk_size=8, l0_bytes=3 * 8 * 512)  # three 8-token chunks of 512 B/token
    try:
        prompt = text_of_length(70)  # eight whole chunks and a tail
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        run(engine, prompt=prompt)
        engine.flush_writes()
        for repeat in (1, 2):
            answer = run(engine, prompt=prompt)
            engine.flush_writes()  # the fetched chunks' copies for L0 (not kept: only the head's room)
            stats = engine.stats()
            assert answer.output_token_ids == expected and answer.cached_tokens == 69
            assert stats["l0_chunks_hit"] == 3 * repeat  # the first three chunks, every time
            assert stats["l0_chunks_held"] == 3 and stats["l0_chunks_evicted"] == 0
    finally:
        engine.close()


def test_auto_sizes_l0_and_the_slots_from_the_ram_available_and_says_so(tiny_llama, monkeypatch, caplog):
    from inference_service.kv_memory import memory_plan
    monkeypatch.setattr(memory_plan, "host_memory", lambda: (8 << 30, 16 << 30))
    with caplog.at_level("INFO", logger="inference_service.kv_memory.memory_plan"):
        engine = make_engine(tiny_llama)  # kv_cache_bytes and l0_bytes left to auto
    try:
        assert (engine.config.kv_cache_bytes, engine.config.l0_bytes) == (2 << 30, 2 << 30)
        assert engine.stats()["kv_budget_bytes"] == 2 << 30
        assert "8.0 GiB of RAM available" in caplog.text and "= 4194304 tokens" in caplog.text  # 512 B a token
    finally:
        engine.close()


@pytest.mark.parametrize("recompute_when_faster", [True, None])  # None: the default, on CUDA only
def test_a_tier_measured_slower_than_prefill_is_recomputed_instead_and_counted(tiny_llama, recompute_when_faster):
    engine = make_engine(tiny_llama, l0_bytes=0, recompute_when_faster=recompute_when_faster)
    try:
        prompt = text_of_length(64)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        run(engine, prompt=prompt)
        engine.flush_writes()
        # Measured: the store places 1 byte a second, prefill runs a million tokens a second.
        engine.parts.counters.chooser.load_meter("store").seed([(1, 1.0), (2, 2.0)])
        engine.parts.counters.chooser.prefill.seed([(1e6, 1.0), (2e6, 2.0)])
        again = run(engine, prompt=prompt)
        skipped = recompute_when_faster is True
        assert again.output_token_ids == expected
        assert again.cached_tokens == (0 if skipped else 63)
        assert (engine.stats()["loads_skipped"], engine.stats()["load_skipped_tokens"]) == ((1, 64) if skipped
                                                                                             else (0, 0))
    finally:
        engine.close()
