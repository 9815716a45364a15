"""The promise, property-tested on the engine: in the default mode every answer is plain `model.generate`'s, however
repetitive the prompts and whatever order they come in; with approximate reuse asked for, an answer says
`approximate` exactly when it used a content hit, and an unlabelled one is still exact."""
from __future__ import annotations

import itertools
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_service.store.memory import InMemoryStore
from kvboost_keys.prompts import tokenize_prompt
from tests.factories import build_tiny_model
from tests.inference_service.engine.test_engine import make_engine, reference_ids, run
from tests.repetitive_prompts import Workload, workloads

MAX_NEW_TOKENS = 6
CHUNK_SIZE = 8  # many chunk boundaries in a few hundred byte tokens: repeated chunks everywhere
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                    HealthCheck.function_scoped_fixture])
_salts = itertools.count()


@lru_cache(maxsize=None)
def tiny(kind: str):
    return build_tiny_model(kind)


@lru_cache(maxsize=4096)
def expected_ids(kind: str, token_ids: tuple[int, ...]) -> list[int]:
    return reference_ids(tiny(kind)[0], list(token_ids), MAX_NEW_TOKENS)


def reference(kind: str, prompt: str) -> list[int]:
    return expected_ids(kind, tuple(tokenize_prompt(tiny(kind)[1], prompt)[0]))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def default_engine(request):
    engine = make_engine(tiny(request.param), chunk_size=CHUNK_SIZE)  # no default_mode given: the default
    yield request.param, engine
    engine.close()


@PROPERTY_SETTINGS
@given(workload=workloads())
def test_default_mode_answers_are_model_generate_and_never_approximate(default_engine, workload: Workload):
    kind, engine = default_engine
    salt = f"example-{next(_salts)}"  # a namespace of its own: every example starts from an empty cache
    asked_before: set[str] = set()
    for prompt in workload.asked():
        outcome = run(engine, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, cache_salt=salt)
        assert outcome.mode == "prefix_cache"
        assert outcome.output_token_ids == reference(kind, prompt), f"prompt {prompt!r} after {workload.asked()!r}"
        assert (outcome.approximate, outcome.approximate_tokens) == (False, 0)
        if prompt in asked_before:  # the same prompt again: cached to its last token (which runs for the logits)
            assert outcome.cached_tokens == outcome.prompt_tokens - 1
        asked_before.add(prompt)
    baseline = run(engine, prompt=workload.prompts[-1], max_new_tokens=MAX_NEW_TOKENS, mode="baseline",
                   cache_salt=salt)
    assert baseline.output_token_ids == reference(kind, workload.prompts[-1])
    assert engine.stats()["approximate_answers"] == 0


class SwappableStore:
    """A store whose contents are replaced before each use: the twin engine sees a copy of the other's cache."""

    def __init__(self) -> None:
        self.inner = InMemoryStore()

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def opt_in_engines():
    """(engine, twin, the twin's store): the twin answers in prefix_cache mode over a copy of the engine's cache, to
    say how much of each prompt exact reuse alone gives."""
    store, twin_store = InMemoryStore(), SwappableStore()
    engine = make_engine(tiny("llama"), chunk_size=CHUNK_SIZE, cache=store)
    # No L0 in the twin: it would remember what the twin computed in earlier examples, beyond the engine's cache.
    twin = make_engine(tiny("llama"), chunk_size=CHUNK_SIZE, cache=twin_store, l0_bytes=0)
    yield engine, store, twin, twin_store
    engine.close()
    twin.close()


@PROPERTY_SETTINGS
@given(workload=workloads(), strategy=st.sampled_from(["none", "selective", "cacheblend"]))
def test_opt_in_labels_exactly_the_answers_that_used_content_hits(opt_in_engines, workload: Workload, strategy):
    engine, store, twin, twin_store = opt_in_engines
    salt = f"opt-in-{next(_salts)}"
    num_approximate = 0
    for prompt in workload.asked():
        twin_store.inner = store.copy()
        exact = run(twin, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, mode="prefix_cache", cache_salt=salt)
        # An exact answer over a cache that approximate requests share is still model.generate's.
        assert exact.output_token_ids == reference("llama", prompt)
        outcome = run(engine, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, mode="chunk_kv_reuse",
                      recompute_strategy=strategy, cache_salt=salt)
        used_content_hits = outcome.cached_tokens > exact.cached_tokens
        assert outcome.approximate == used_content_hits, f"prompt {prompt!r} after {workload.asked()!r}"
        # Content-hit tokens are the cached ones beyond exact reuse; those repair recomputed are not approximate.
        expected_tokens = outcome.cached_tokens - exact.cached_tokens - outcome.recomputed_tokens
        assert outcome.approximate_tokens == (expected_tokens if used_content_hits else 0)
        if not outcome.approximate:  # an unlabelled answer is exact
            assert outcome.output_token_ids == reference("llama", prompt)
            assert outcome.cached_tokens == exact.cached_tokens
        num_approximate += outcome.approximate
    assert engine.stats()["approximate_answers"] >= num_approximate


def test_the_same_repetitive_prompt_asked_again_is_cached_to_its_last_token():
    """The issue's case on the tiny model: '0 ' + 'hi ' * N, then '3 ' + the same body (no exact reuse: its first
    chunk differs), then the first again (cached to its last token), all model.generate's answers."""
    engine = make_engine(tiny("llama"), chunk_size=CHUNK_SIZE)
    try:
        first, other = "0 " + "hi " * 300, "3 " + "hi " * 300
        outcomes = [run(engine, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS) for prompt in (first, other, first)]
        assert [outcome.cached_tokens for outcome in outcomes] == [0, 0, len(first) - 1]
        assert all(outcome.output_token_ids == reference("llama", prompt)
                   for outcome, prompt in zip(outcomes, (first, other, first)))
        assert not any(outcome.approximate for outcome in outcomes)
        # Asked for, the other lead reuses the body by content: labelled.
        opted = run(engine, prompt="5 " + "hi " * 300, max_new_tokens=MAX_NEW_TOKENS, mode="chunk_kv_reuse")
        assert opted.approximate and opted.approximate_tokens > 0
        assert engine.stats()["approximate_answers"] == 1
    finally:
        engine.close()
