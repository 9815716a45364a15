"""The host tier in the engine: a prompt L0 does not hold comes back from it, token-identical to model.generate and
counted under tier `host`; a Delete at the daemon stops its hits; its memory stays bounded; on a CPU it is off by
default (auto) and the answers do not change."""
from __future__ import annotations

import logging

from inference_service.engine.engine import GenerationParams
from inference_service.store.memory import InMemoryStore
from kvboost_keys.prompts import tokenize_prompt
from tests.inference_service.engine.test_engine import make_engine, reference_ids, run, text_of_length

CHUNK = 8
CHUNK_BYTES = CHUNK * 512  # the tiny models' K/V: 512 bytes a token


def test_a_prompt_l0_does_not_hold_comes_back_from_the_host_tier_exact_and_counted(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=CHUNK, l0_bytes=0, host_tier_bytes=16 * CHUNK_BYTES)
    try:
        prompt = text_of_length(70)  # eight whole chunks and a tail
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        assert run(engine, prompt=prompt).output_token_ids == expected
        fetched = engine.stats()["chunks_fetched"]
        second = run(engine, prompt=prompt)
        stats = engine.stats()
        assert second.output_token_ids == expected and second.cached_tokens == 69
        # The prompt's eight whole chunks, and those the first answer's tokens completed (stored with the answer).
        assert stats["host_chunks_hit"] == 8 and stats["host_chunks_held"] == (70 + len(expected)) // CHUNK
        assert stats["tier_loads"]["host"]["chunks"] == 8 and stats["tier_loads"]["host"]["bytes"] == 64 * 512
        assert stats["chunks_fetched"] == fetched + 1  # only the tail (a partial chunk) came from the store
    finally:
        engine.close()


def test_l0_keeps_the_head_and_the_host_tier_the_rest_of_a_long_prompt(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=CHUNK, l0_bytes=3 * CHUNK_BYTES,
                         host_tier_bytes=16 * CHUNK_BYTES)
    try:
        prompt = text_of_length(70)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        run(engine, prompt=prompt)
        answer = run(engine, prompt=prompt)
        stats = engine.stats()
        assert answer.output_token_ids == expected and answer.cached_tokens == 69
        assert (stats["l0_chunks_hit"], stats["host_chunks_hit"]) == (3, 5)  # tier order: L0, then the host tier
        assert set(stats["tier_loads"]) >= {"l0", "host"}
    finally:
        engine.close()


def test_a_delete_at_the_daemon_stops_host_tier_hits(tiny_llama):
    store = InMemoryStore()
    engine = make_engine(tiny_llama, chunk_size=CHUNK, cache=store, l0_bytes=0,
                         host_tier_bytes=16 * CHUNK_BYTES)
    try:
        prompt = text_of_length(40)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        run(engine, prompt=prompt)
        plan = engine.plan_request(GenerationParams(prompt=prompt))[1]
        store.delete(list(plan.prefix_keys))  # as the daemon's Delete (or a namespace drop) would
        answer = run(engine, prompt=prompt)
        stats = engine.stats()
        assert answer.output_token_ids == expected
        assert stats["host_chunks_hit"] == 0  # held, but the daemon said no
        assert stats["host_chunks_held"] == (40 + len(expected)) // CHUNK
        assert answer.cached_tokens < CHUNK  # nothing whole was reused
    finally:
        engine.close()


def test_the_host_tier_stays_within_its_bytes_and_answers_stay_exact(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=CHUNK, l0_bytes=2 * CHUNK_BYTES,
                         host_tier_bytes=3 * CHUNK_BYTES + 100)
    try:
        prompts = [text_of_length(40), "Another text entirely, forty tokens long!", text_of_length(33)[::-1]]
        for prompt in prompts + prompts:
            expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
            assert run(engine, prompt=prompt).output_token_ids == expected
        stats = engine.stats()
        assert stats["host_tier_bytes"] == 3 * CHUNK_BYTES and stats["host_bytes_held"] <= 3 * CHUNK_BYTES
        assert engine.parts.host.region.numel() == 3 * CHUNK_BYTES  # the one region, never grown
    finally:
        engine.close()


def test_on_a_cpu_auto_keeps_no_host_tier_and_says_so(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="inference_service.kv_memory.memory_plan"):
        engine = make_engine(tiny_llama, chunk_size=CHUNK, host_tier_bytes=None)
    default = make_engine(tiny_llama, chunk_size=CHUNK)
    try:
        assert engine.parts.host is None and engine.config.host_tier_bytes == 0
        assert "host tier off: on a CPU L0 already is host memory" in caplog.text
        assert default.parts.host is None and "host_chunks_hit" not in default.stats()
    finally:
        engine.close()
        default.close()


def test_a_given_host_tier_is_logged_with_the_tokens_it_holds(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="inference_service.kv_memory.memory_plan"):
        engine = make_engine(tiny_llama, chunk_size=CHUNK, host_tier_bytes=1 << 20)
    try:
        assert "host tier 0.00 GiB (given) = 2048 tokens (pageable host memory" in caplog.text
        assert engine.parts.host.max_bytes == 1 << 20
    finally:
        engine.close()


def test_chunks_fetched_from_the_store_join_the_host_tier(tiny_llama):
    store = InMemoryStore()
    writer = make_engine(tiny_llama, chunk_size=CHUNK, cache=store)
    reader = make_engine(tiny_llama, chunk_size=CHUNK, cache=store, l0_bytes=0,
                         host_tier_bytes=16 * CHUNK_BYTES)  # another process sharing the daemon, with no L0
    try:
        prompt = text_of_length(64)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        run(writer, prompt=prompt)
        from_store = run(reader, prompt=prompt)  # fetched (checked once, on the way in), then copied to the host tier
        assert reader.stats()["host_chunks_hit"] == 0 and reader.stats()["host_chunks_held"] >= 7
        from_host = run(reader, prompt=prompt)
        assert reader.stats()["host_chunks_hit"] == 8  # all 8 whole chunks placed; the last token runs again
        assert from_store.output_token_ids == from_host.output_token_ids == expected
    finally:
        writer.close()
        reader.close()
