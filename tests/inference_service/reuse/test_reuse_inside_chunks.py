"""Reuse to the last shared token: a prompt that shares a stored chunk's first m tokens (after the same parent
key) reuses exactly those m tokens' K/V, through the in-process store and a real cache daemon over gRPC.
Greedy outputs stay those of plain model.generate."""
from __future__ import annotations

import pytest

from kvboost_keys.prompts import tokenize_prompt
from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions
from inference_service.store.memory import InMemoryStore
from tests.daemon_support import running_daemon
from tests.inference_service.engine.test_engine import make_engine, reference_ids, run, text_of_length

DOCUMENT = text_of_length(45)  # byte tokenizer: one token per character
QUESTIONS = ("Q: who jumps over whom?", "Q: who is lazy?", "Q: what colour is the fox?")


def shared_tokens(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(params=["memory", "daemon"])
def store(request, tmp_path):
    if request.param == "memory":
        yield InMemoryStore()
        return
    with running_daemon(tmp_path / "lmdb") as daemon:
        store = GrpcChunkStore(GrpcStoreOptions(address=daemon.address))
        try:
            yield store
        finally:
            store.close()


@pytest.mark.parametrize("chunk_size", [8, 16])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_follow_up_questions_reuse_every_shared_token(fixture, chunk_size, store, request):
    model_and_tokenizer = request.getfixturevalue(fixture)
    model, tokenizer = model_and_tokenizer
    engine = make_engine(model_and_tokenizer, chunk_size=chunk_size, cache=store)
    try:
        previous: list[list[int]] = []
        for question in QUESTIONS:
            prompt = DOCUMENT + " " + question
            ids = tokenize_prompt(tokenizer, prompt)[0]
            outcome = run(engine, prompt=prompt, mode="prefix_cache")
            assert outcome.output_token_ids == reference_ids(model, ids), question
            if previous:
                expected = min(max(shared_tokens(ids, seen) for seen in previous), len(ids) - 1)
                # Not a whole number of chunks: the last shared tokens sit inside a stored chunk.
                assert expected % chunk_size
                assert outcome.cached_tokens == expected, question
            previous.append(ids)
        stats = engine.stats()
        assert stats["partial_cached_tokens"] > 0
        assert stats["computed_tokens"] == stats["prompt_tokens"] - stats["cached_tokens"]
    finally:
        engine.close()


def test_a_stored_chunk_from_another_parent_is_never_used(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama, chunk_size=8)
    try:
        run(engine, prompt="Alpha beta gamma delta. " + DOCUMENT, mode="prefix_cache")
        # The same document after another opening: every chunk has another parent, nothing is shared.
        prompt = "Omega psi chi phi. " + DOCUMENT
        outcome = run(engine, prompt=prompt, mode="prefix_cache")
        assert outcome.cached_tokens == 0
        assert outcome.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])
    finally:
        engine.close()
