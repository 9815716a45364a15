"""Edge cases of CHUNK_KV_REUSE and of batch write-back, checked against plain transformers `model.generate`."""
from __future__ import annotations

import pytest

from inference_service.store.protocol import StoreUnavailable
from inference_service.store.memory import InMemoryStore
from kvboost_keys.prompts import tokenize_prompt, tokenize_segments
from tests.inference_service.engine.test_engine import make_engine, reference_ids, run
from tests.inference_service.engine.test_engine_content import DOC_A, DOC_B, QUESTION, content_engine


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ids_of_segments(tokenizer, segments) -> list[int]:
    return [token for segment in tokenize_segments(tokenizer, segments) for token in segment]


class FetchFailsFromItem(InMemoryStore):
    """Fetch streams raise StoreUnavailable at item `fail_at` once armed (lookups and stores still work)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: int | None = None

    def fetch(self, keys):
        items = super().fetch(keys)
        if self.fail_at is None:
            return items

        def failing():
            for index, item in enumerate(items):
                if index >= self.fail_at:
                    raise StoreUnavailable("daemon went away")
                yield item
        return failing()


@pytest.mark.parametrize("fail_at", [0, 2])
def test_cache_lost_during_the_content_fetch_is_degraded_and_stores_nothing(tiny_llama, fail_at):
    # fail_at=0: no content hit placed, so the prefix-only fallback runs; it must still report the request
    # degraded and not write back to a cache that just went away.
    cache = FetchFailsFromItem()
    engine = content_engine(tiny_llama, cache=cache)
    stored_before = engine.stats()["chunks_stored"]
    cache.fail_at = fail_at
    segments = ("Hi: ", DOC_B, DOC_A, QUESTION)
    outcome = run(engine, segments=segments, mode="chunk_kv_reuse", recompute_strategy="none")
    assert outcome.degraded
    assert engine.stats()["chunks_stored"] == stored_before
    if fail_at == 0:  # nothing reused: plain generate's output
        assert outcome.cached_tokens == 0
        assert outcome.output_token_ids == reference_ids(tiny_llama[0], ids_of_segments(tiny_llama[1], segments))


@pytest.mark.parametrize("last_document", [DOC_A, DOC_A[:64]])  # a 3-token tail, or a content hit on the last token
def test_a_prompt_made_of_content_hits_equals_generate_when_all_are_recomputed(tiny_llama, last_document):
    engine = content_engine(tiny_llama)
    engine.warm(last_document, content_addressed=True)
    segments = ("Hi: ", DOC_B, last_document)
    outcome = run(engine, segments=segments, mode="chunk_kv_reuse", recompute_strategy="cacheblend",
                  recompute_ratio=1.0)
    num_tokens = len(ids_of_segments(tiny_llama[1], segments))
    full_chunks_of_last = len(last_document) // 8 * 8
    # Every document token is a content hit except the last segment's tail; the prompt's last token always runs.
    assert outcome.cached_tokens == min(len(DOC_B) + full_chunks_of_last, num_tokens - 1 - 4)
    assert outcome.recomputed_tokens == outcome.cached_tokens
    assert outcome.output_token_ids == reference_ids(tiny_llama[0], ids_of_segments(tiny_llama[1], segments))


@pytest.mark.parametrize("overlap", [8, 20, 60])  # one chunk, across chunks, longer than document B's whole run
def test_overlap_longer_than_a_run_stores_nothing(tiny_llama, overlap):
    engine = content_engine(tiny_llama, overlap_tokens=overlap)
    segments = ("Hi: ", DOC_B, DOC_A, QUESTION)
    reused = run(engine, segments=segments, mode="chunk_kv_reuse", recompute_strategy="none")
    # Document B starts at 4, document A at 56: each run's first `overlap` tokens run fresh, windows may overlap.
    fresh = set(range(4, 4 + overlap)) | set(range(56, 56 + overlap))
    assert reused.cached_tokens == len(set(range(4, 56 + len(DOC_A))) - fresh)
    assert reused.recomputed_tokens == 0 and reused.approximate
    again = run(engine, segments=segments, mode="prefix_cache")
    # A request that used content hits stores nothing (its K/V came through the repair's forward).
    assert again.cached_tokens == 0
    assert again.output_token_ids == reference_ids(tiny_llama[0], ids_of_segments(tiny_llama[1], segments))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_batch_rows_write_back_their_own_chunks_exactly(fixture, request):
    """The chunks each row of a batch writes back (past the shared prefix, computed in a batched prefill
    with pads) must be exact: the same prompts run alone afterwards reuse them and still equal generate."""
    model, tokenizer = request.getfixturevalue(fixture)
    engine = make_engine((model, tokenizer))
    system = "The quick brown fox jumps over the lazy dog. " * 2  # 90 tokens
    prompts = [system + q for q in ("Q1?", "A much longer question here, with padding to spare?", "Mid-sized one?")]
    engine.generate_batch([engine_params(p) for p in prompts])
    engine.flush_writes()
    alone = [run(engine, prompt=p, mode="prefix_cache", max_new_tokens=10) for p in prompts]
    lengths = [len(tokenize_prompt(tokenizer, p)[0]) for p in prompts]
    # Every whole chunk and each row's tail (a partial chunk, as a single request stores it): all but the last token.
    assert [o.cached_tokens for o in alone] == [n - 1 for n in lengths]  # 92, 140, 103
    assert [o.output_token_ids for o in alone] == [
        reference_ids(model, tokenize_prompt(tokenizer, p)[0], 10) for p in prompts]


def engine_params(prompt: str):
    from inference_service.engine.engine import GenerationParams
    return GenerationParams(prompt=prompt, mode="prefix_cache", max_new_tokens=10)


def test_a_batch_row_over_max_prompt_tokens_is_named_by_its_index(tiny_llama):
    from inference_service.engine.engine import GenerationParams
    from inference_service.errors import PromptTooLong

    engine = make_engine(tiny_llama, max_prompt_tokens=32)
    with pytest.raises(PromptTooLong, match=r"^requests\[1\]: prompt has 40 tokens; at most 32 are accepted$"):
        engine.generate_batch([GenerationParams(prompt="fine"), GenerationParams(prompt="x" * 40)])


def test_a_short_prompt_with_many_new_tokens_beside_a_long_one(tiny_llama):
    """Left padding puts the short prompt's new tokens after the long prompt: the buffers must hold them,
    also once other rows have finished and left the batch."""
    from inference_service.engine.engine import GenerationParams

    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama)
    prompts = ["The quick brown fox jumps over the lazy dog. " * 2, "Short one", "Short two"]
    limits = [1, 20, 30]
    outcomes = engine.generate_batch([GenerationParams(prompt=p, max_new_tokens=n, mode="baseline")
                                       for p, n in zip(prompts, limits)])
    assert [o.output_token_ids for o in outcomes] == [
        reference_ids(model, tokenize_prompt(tokenizer, p)[0], n) for p, n in zip(prompts, limits)]
