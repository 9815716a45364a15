"""Real SmolLM2 through the running cache daemon: with prefix hits, greedy output equals plain model.generate."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from inference_service.store.grpc_store import GrpcStoreOptions, GrpcChunkStore
from tests.conftest import wait_for
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from kvboost_keys.prompts import tokenize_messages, tokenize_prompt
from tests.e2e.daemon_process import start_daemon

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_NEW_TOKENS = 8
PASSAGE = (
    "The old observatory stood on a hill above the town. Every night the astronomer climbed the narrow "
    "stairs, opened the dome and pointed the telescope at a different part of the sky. She kept careful "
    "notes: the date, the weather, the seeing, and every comet or variable star she found. Over forty years "
    "the notebooks filled three shelves. When the town built a school, her notes became its first library, "
    "and children learned to read from descriptions of Saturn's rings, the phases of Venus and the slow "
    "turning of the Milky Way. Visitors still come to see the brass telescope, polished every spring. "
)
QUESTIONS = ("What did she keep?", "Where was the observatory?", "Summarise the story.", "Who polishes it?")


def exact_length_prompts(tokenizer, lengths: list[int]) -> list[str]:
    """Texts of exactly the given token counts (cut out of the passage where they re-tokenize as cut)."""
    ids = tokenize_prompt(tokenizer, PASSAGE * 4)[0]
    prompts = []
    for length in lengths:
        for start in range(0, len(ids) - length):
            text = tokenizer.decode(ids[start:start + length])
            if tokenize_prompt(tokenizer, text)[0] == ids[start:start + length]:
                prompts.append(text)
                break
        else:
            raise AssertionError(f"no cut of the passage re-tokenizes to {length} tokens")
    return prompts


def identity_cases(tokenizer) -> list[dict]:
    """52 requests: short, chunk-aligned, one past a boundary, mixed lengths, multi-turn chats."""
    short = [{"prompt": text} for text in ("Hi!", "What is 2+2?", "Name a colour.", "Tell me a joke.")]
    aligned = [{"prompt": text} for text in exact_length_prompts(tokenizer, [32, 64, 96, 128, 192, 256])]
    one_past = [{"prompt": text} for text in exact_length_prompts(tokenizer, [33, 65, 97, 129, 193, 257])]
    one_before = [{"prompt": text} for text in exact_length_prompts(tokenizer, [31, 63, 127])]
    mixed = [{"prompt": PASSAGE[: 60 * n] + " " + QUESTIONS[n % 4]} for n in range(1, 19)]
    chats = []
    for n in range(1, 11):
        turns = [("system", "You are a helpful assistant. " + PASSAGE[: 40 * n])]
        for turn in range(n % 4 + 1):
            turns += [("user", QUESTIONS[turn]), ("assistant", PASSAGE[30 * turn : 30 * turn + 50])]
        chats.append({"messages": tuple(turns + [("user", QUESTIONS[n % 4])])})
    chats += [{"messages": (("user", QUESTIONS[n]),)} for n in range(4)]
    cases = short + aligned + one_past + one_before + mixed + chats + [{"prompt": PASSAGE}]
    assert len(cases) >= 50
    return cases


@pytest.fixture(scope="module")
def daemon_cache(tmp_path_factory):
    from tests.conftest import pick_free_port

    daemon = start_daemon(tmp_path_factory.mktemp("identity") / "lmdb", pick_free_port(), "--max-bytes", "2GB")
    cache = GrpcChunkStore(GrpcStoreOptions(address=daemon.address))
    try:
        yield cache
    finally:
        cache.close()
        daemon.terminate()


@pytest.fixture(scope="module")
def references(smollm2, smollm2_reference) -> list[tuple[dict, list[int], Future]]:
    """(request fields, prompt token ids, plain model.generate output) per case, each asked once of the
    reference process (tests/reference_process.py: transformers' default attention, one prompt per generate
    call; SmolLM2 has 3 query heads per K/V head, and the engine's grouped-query SDPA runs only in calls that
    pass the engine's keyword, tests/inference_service/model/test_attention.py), which computes them while
    the engine runs the cases."""
    _, tokenizer, _ = smollm2
    rows = []
    for case in identity_cases(tokenizer):
        token_ids = (tokenize_messages(tokenizer, case["messages"]) if "messages" in case
                     else tokenize_prompt(tokenizer, case["prompt"]))[0]
        rows.append((case, token_ids, smollm2_reference.submit(token_ids, MAX_NEW_TOKENS)))
    return rows


@pytest.mark.parametrize("chunk_size", [32, 64, 128])
def test_prefix_hits_are_token_identical_to_generate(smollm2, daemon_cache, references, chunk_size):
    model, tokenizer, path = smollm2
    assert model.config.num_attention_heads == 3 * model.config.num_key_value_heads  # grouped-query attention
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=chunk_size), daemon_cache, model_id=path)
    rows = references
    if chunk_size > 32:  # later chunk sizes on a third of the cases with a full chunk keep the test short
        rows = [row for row in rows if len(row[1]) > chunk_size][::3]
    mismatches, hits = [], 0
    for case, token_ids, reference in rows:
        outcomes = []
        for _ in range(2):  # the first call misses and writes back, the second hits
            outcomes.append(engine.generate(GenerationParams(**case, max_new_tokens=MAX_NEW_TOKENS, mode="prefix_cache")))
            engine.flush_writes()
        assert not any(outcome.degraded for outcome in outcomes)
        # Whole chunks and the tail's partial chunk, written back by the first call: all but the last token.
        assert outcomes[1].cached_tokens == len(token_ids) - 1, case
        hits += outcomes[1].cached_tokens > 0
        expected = reference.result()
        if [outcome.output_token_ids for outcome in outcomes] != [expected, expected]:
            mismatches.append((case, expected, [outcome.output_token_ids for outcome in outcomes]))
    assert mismatches == []
    assert hits >= len(rows) * 0.7, "most cases must exercise prefix hits"


def test_continuous_batching_is_token_identical_to_generate(smollm2, daemon_cache, references):
    """Every case through the engine's step loop, arriving two per step so rows of all lengths share decode
    steps: first with misses (the write-back runs meanwhile), then again with prefix hits."""
    model, tokenizer, path = smollm2
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=32), daemon_cache, model_id=path + "#continuous")
    for attempt in range(2):
        results: dict[int, object] = {}
        for start in range(0, len(references), 2):
            steps = engine.core.num_steps
            for index, (case, _, _) in enumerate(references[start : start + 2], start):
                def done(outcomes, error, index=index, results=results):
                    results[index] = error or outcomes[0]
                engine.submit(GenerationParams(**case, max_new_tokens=MAX_NEW_TOKENS, mode="prefix_cache"), None,
                              lambda: False, done)
            wait_for(lambda steps=steps, start=start, results=results: engine.core.num_steps > steps
                     or len(results) > start, timeout_s=60, what="a step of the engine")
        wait_for(lambda results=results: len(results) == len(references), timeout_s=300, what="every case")
        engine.flush_writes()
        mismatches = [(case, reference.result(), results[index].output_token_ids)
                      for index, (case, _, reference) in enumerate(references)
                      if results[index].output_token_ids != reference.result()]
        assert mismatches == [], f"attempt {attempt}"
        if attempt == 1:
            hits = sum(results[index].cached_tokens == len(ids) - 1 for index, (_, ids, _) in enumerate(references))
            assert hits == len(references), "the second attempt reuses all but the last token"
