"""A text's partial last chunk is stored and reused to its last token; outputs stay those of model.generate."""
from __future__ import annotations

from kvboost_keys.prompts import plan_prompt, tokenize_prompt
from inference_service.store.memory import InMemoryStore
from tests.inference_service.engine.test_engine import (  # noqa: F401 (tiny_model is a fixture)
    make_engine, reference_ids, run, text_of_length, tiny_model,
)

# With the byte-level tiny tokenizer one character is one token; chunk size 8.
DOCUMENT = text_of_length(30)  # 3 whole chunks, then a 6-token tail
QUESTION = " Q: who jumps?"  # 14 tokens: the document's chunk 3 becomes whole, then a tail


class RecordingStore(InMemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.lookups: list[tuple[int, int]] = []  # (prefix keys, partial keys) per Lookup
        self.fetches: list[list[bytes]] = []

    def lookup(self, namespace, prefix_keys, content_keys=None, partial_keys=None, continuation=None, after_run=None):
        self.lookups.append((len(prefix_keys), len(partial_keys or ())))
        return super().lookup(namespace, prefix_keys, content_keys, partial_keys, continuation, after_run)

    def fetch(self, keys):
        self.fetches.append(list(keys))
        return super().fetch(keys)


def test_a_warmed_unaligned_document_is_reused_to_its_last_token(tiny_model):
    model, tokenizer = tiny_model
    store = RecordingStore()
    engine = make_engine(tiny_model, cache=store, l0_bytes=0)  # counts the store's fetches (L0 spares them)
    warmed = engine.warm(DOCUMENT)
    store.lookups.clear()

    outcome = run(engine, prompt=DOCUMENT + QUESTION, mode="prefix_cache")

    assert (warmed.chunks_stored, warmed.partial_tail_tokens) == (3 + 1, 6)
    assert outcome.cached_tokens == 30
    assert outcome.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, DOCUMENT + QUESTION)[0])
    # One Lookup of the 5 whole chunks (3 hit) that also answers the partial chunk inside chunk 3 (AfterRun: the
    # store derives the 7 candidates from the run it finds), one Fetch of 4 blobs.
    assert store.lookups == [(5, 0)]
    plan = plan_prompt(engine.namespace, tokenize_prompt(tokenizer, DOCUMENT)[0:1], 8)
    assert store.fetches[0] == [*plan.prefix_keys, plan.tail_key]
    # Counted by source: 24 tokens from whole chunks, 6 from the partial one, the rest prefilled.
    stats = engine.stats()
    prompt_tokens = len(tokenize_prompt(tokenizer, DOCUMENT + QUESTION)[0])
    assert (stats["cached_tokens"], stats["partial_cached_tokens"]) == (30, 6)
    assert stats["computed_tokens"] == stats["prompt_tokens"] - 30 == prompt_tokens - 30


class OlderDaemonStore(RecordingStore):
    """A daemon from before continue_after_run: it ignores the field (continued stays False)."""

    def lookup(self, namespace, prefix_keys, content_keys=None, partial_keys=None, continuation=None, after_run=None):
        return super().lookup(namespace, prefix_keys, content_keys, partial_keys, continuation)


def test_an_older_daemon_gets_the_second_lookup_and_the_same_reuse(tiny_model):
    model, tokenizer = tiny_model
    store = OlderDaemonStore()
    engine = make_engine(tiny_model, cache=store, l0_bytes=0)
    engine.warm(DOCUMENT)
    store.lookups.clear()
    outcome = run(engine, prompt=DOCUMENT + QUESTION, mode="prefix_cache")
    assert store.lookups == [(5, 0), (0, 7)]  # the run, then the 7 partial candidates inside chunk 3
    assert outcome.cached_tokens == 30
    assert outcome.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, DOCUMENT + QUESTION)[0])


def test_the_chunk_that_held_the_partial_hit_is_stored_whole_afterwards(tiny_llama):
    model, tokenizer = tiny_llama
    store = InMemoryStore()
    engine = make_engine(tiny_llama, cache=store)
    engine.warm(DOCUMENT)
    run(engine, prompt=DOCUMENT + QUESTION, mode="prefix_cache")  # reuses 30 tokens, writes back chunks 3 and 4
    longer = DOCUMENT + QUESTION + " The fox."

    outcome = run(engine, prompt=longer, mode="prefix_cache")

    # Chunks 0-4 (40 tokens) are whole now: chunk 3's K/V joined 6 fetched tokens and 2 computed ones.
    assert outcome.cached_tokens >= 40
    assert outcome.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, longer)[0])


def test_a_prompt_that_leaves_the_text_inside_the_tail_reuses_it_to_the_last_shared_token(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama)
    engine.warm(DOCUMENT)
    changed = DOCUMENT[:28] + "XY" + QUESTION  # the tail's last 2 tokens differ

    outcome = run(engine, prompt=changed, mode="prefix_cache")

    assert outcome.cached_tokens == 28  # 3 whole chunks, then the stored tail's first 4 tokens
    assert outcome.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, changed)[0])


def test_a_prompt_ending_inside_the_stored_tail_runs_only_its_last_token(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama)
    engine.warm(DOCUMENT)
    prefix = DOCUMENT[:27]  # ends 3 tokens into the 6-token tail: the stored tail shares those 3

    exact = run(engine, prompt=DOCUMENT, mode="prefix_cache")
    shorter = run(engine, prompt=prefix, mode="prefix_cache")

    assert exact.cached_tokens == 29  # all but the last token, which always runs
    assert shorter.cached_tokens == 26  # 3 whole chunks and 2 of the tail's tokens: all but the last
    assert exact.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, DOCUMENT)[0])
    assert shorter.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, prefix)[0])


def test_baseline_looks_nothing_up_and_chunk_kv_reuse_takes_partial_hits_too(tiny_llama):
    model, tokenizer = tiny_llama
    store = RecordingStore()
    engine = make_engine(tiny_llama, cache=store)
    engine.warm(DOCUMENT)
    store.lookups.clear()

    baseline = run(engine, prompt=DOCUMENT + QUESTION, mode="baseline")
    assert store.lookups == [] and baseline.cached_tokens == 0
    reused = run(engine, prompt=DOCUMENT + QUESTION, mode="chunk_kv_reuse")

    assert reused.cached_tokens >= 30
    expected = reference_ids(model, tokenize_prompt(tokenizer, DOCUMENT + QUESTION)[0])
    assert baseline.output_token_ids == reused.output_token_ids == expected
