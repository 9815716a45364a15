"""Engine on the tiny seeded models: greedy output identical to model.generate, cache hits, streaming, errors."""
from __future__ import annotations

import dataclasses

import threading

import pytest
import torch

from inference_service.store.protocol import StoreUnavailable, StoreLookup, NullStore
from inference_service.store.memory import InMemoryStore
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.errors import InvalidRequest, PromptTooLong
from kvboost_keys.prompts import tokenize_messages, tokenize_prompt, tokenize_segments
from inference_service.kv_memory.kv_buffers import kv_geometry
from tests.factories import build_tiny_model

MAX_NEW_TOKENS = 12
CHAT = (
    ("system", "You answer briefly."),
    ("user", "What is the capital of France?"),
    ("assistant", "Paris."),
    ("user", "And of Italy?"),
)


def make_engine(model_and_tokenizer, chunk_size=8, cache=None, **config) -> Engine:
    model, tokenizer = model_and_tokenizer
    cache = InMemoryStore() if cache is None else cache
    return Engine(model, tokenizer, EngineConfig(chunk_size=chunk_size, **config), cache, model_id="tiny")


def text_of_length(num_tokens: int) -> str:
    """A prompt of exactly num_tokens tokens for the byte-level tokenizer (one token per byte)."""
    base = "The quick brown fox jumps over the lazy dog. "
    return (base * (num_tokens // len(base) + 1))[:num_tokens]


def reference_ids(model, token_ids: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """Plain transformers greedy generation: the ground truth."""
    input_ids = torch.tensor([token_ids])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens)
    return output[0, len(token_ids):].tolist()


def run(engine: Engine, **fields):
    fields.setdefault("max_new_tokens", MAX_NEW_TOKENS)
    outcome = engine.generate(GenerationParams(**fields))
    engine.flush_writes()
    return outcome


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def tiny_model(request):
    return request.getfixturevalue(request.param)


# -- identity with model.generate ---------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [8, 16])
@pytest.mark.parametrize("num_tokens", [5, 32, 33, 47, 70])  # short, chunk-aligned, one past, mixed
def test_prefix_reuse_is_token_identical_to_generate(tiny_model, chunk_size, num_tokens):
    model, tokenizer = tiny_model
    engine = make_engine(tiny_model, chunk_size=chunk_size)
    prompt = text_of_length(num_tokens)
    expected = reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])

    first = run(engine, prompt=prompt, mode="prefix_cache")  # misses, writes its chunks back
    second = run(engine, prompt=prompt, mode="prefix_cache")  # hits every full chunk

    assert first.cached_tokens == 0
    assert first.output_token_ids == expected
    assert second.output_token_ids == expected
    # The first run wrote back its whole chunks and its tail as a partial chunk; the last prompt token
    # always runs, so the second reuses all but one token.
    assert second.cached_tokens == num_tokens - 1
    assert second.kv_reuse_ratio == pytest.approx(second.cached_tokens / num_tokens)


@pytest.mark.parametrize("mode", ["baseline", "prefix_cache", "chunk_kv_reuse"])
def test_multi_turn_chat_is_token_identical_in_every_mode(tiny_model, mode):
    model, tokenizer = tiny_model
    engine = make_engine(tiny_model)
    expected = reference_ids(model, tokenize_messages(tokenizer, CHAT)[0])

    outcomes = [run(engine, messages=CHAT, mode=mode) for _ in range(2)]

    assert [o.output_token_ids for o in outcomes] == [expected, expected]
    assert outcomes[1].cached_tokens == (0 if mode == "baseline" else outcomes[1].prompt_tokens - 1)


def test_next_turn_reuses_the_previous_turns_chunks(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama)
    run(engine, messages=CHAT[:2])
    longer = CHAT + (("assistant", "Rome."), ("user", "And of Spain?"))

    outcome = run(engine, messages=longer)

    shared = len(tokenize_messages(tokenizer, CHAT[:2])[0]) // 8 * 8
    assert outcome.cached_tokens >= shared > 0
    assert outcome.output_token_ids == reference_ids(model, tokenize_messages(tokenizer, longer)[0])


def test_segments_are_chunked_from_their_own_start(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama)
    segments = ("System: be brief.\n", text_of_length(21), "Question: what jumps?")
    token_ids = [t for segment in tokenize_segments(tokenizer, segments) for t in segment]

    first = run(engine, segments=segments)
    second = run(engine, segments=segments)

    assert first.output_token_ids == second.output_token_ids == reference_ids(model, token_ids)
    # 18 + 21 + 21 tokens: chunks [0,8) [8,16) [16,18) [18,26) [26,34) [34,39), then the question's 2 full
    # chunks and its 5-token tail, stored as a partial chunk: all but the last token.
    assert second.cached_tokens == 59


def test_sliding_window_model_is_token_identical():
    model, tokenizer = build_tiny_model("mistral_sliding")
    engine = make_engine((model, tokenizer))
    prompt = text_of_length(45)
    expected = reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])

    outcomes = [run(engine, prompt=prompt) for _ in range(3)]

    assert [o.output_token_ids for o in outcomes] == [expected] * 3
    assert outcomes[2].cached_tokens == 44  # whole chunks and the partial tail chunk: all but the last token


# -- cache behaviour ----------------------------------------------------------------------------------


def test_baseline_never_touches_the_cache(tiny_llama):
    cache = RecordingCache()
    engine = make_engine(tiny_llama, cache=cache)
    run(engine, prompt=text_of_length(40), mode="baseline")
    assert cache.calls == []


def test_write_back_happens_after_the_first_token(tiny_llama):
    cache = RecordingCache()
    engine = make_engine(tiny_llama, cache=cache, max_answer_tokens_stored=0,  # the prompt's write-back only
                         l0_bytes=0)  # the second request fetches from the store (L0 would spare it)
    streamed: list[str] = []
    submitted_after: list[int] = []  # tokens streamed when the write-back was handed to the background thread
    submit = engine.parts.writeback.submit
    engine.parts.writeback.submit = lambda pending, *rest: (submitted_after.append(len(streamed)), submit(pending, *rest))
    # The background store may not start before the test lets it, so the request cannot race it.
    may_store = threading.Event()

    def on_store():
        assert may_store.wait(10), "the test never let the write-back run"
        cache.calls.append("store")
    cache.on_store = on_store

    engine.generate(GenerationParams(prompt=text_of_length(40), max_new_tokens=4),
                    on_token=lambda event: streamed.append(event.text))
    cold = list(cache.calls)
    may_store.set()
    engine.flush_writes()

    assert submitted_after == [1]  # submitted on the generating thread right after the first token, once
    assert cold and set(cold) == {"lookup"}  # a cold cache: nothing fetched, and the store was held back
    assert cache.calls == cold + ["store"]
    # Warm, the lookup comes before the fetch, and all of that before the first token.
    streamed.clear()
    engine.generate(GenerationParams(prompt=text_of_length(40), max_new_tokens=4),
                    on_token=lambda event: streamed.append(event.text))
    engine.flush_writes()
    warm = cache.calls[len(cold) + 1:]
    assert warm[0] == "lookup" and "fetch" in warm and submitted_after == [1, 1]


def test_unreachable_cache_serves_degraded_with_the_same_output(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama, cache=UnreachableCache())
    prompt = text_of_length(40)

    outcome = run(engine, prompt=prompt, mode="prefix_cache")

    assert outcome.degraded and outcome.cached_tokens == 0
    assert outcome.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])
    assert engine.stats()["degraded"] is True


def test_corrupted_blob_is_a_miss_from_there_and_is_stored_again(tiny_llama):
    model, tokenizer = tiny_llama
    cache = InMemoryStore()
    engine = make_engine(tiny_llama, cache=cache, l0_bytes=0)  # what the store gives, not L0's copies
    prompt = text_of_length(40)
    run(engine, prompt=prompt)
    second_key = list(cache._entries)[1]
    cache._entries[second_key].blob[-1] ^= 0xFF  # flips a payload byte: the checksum no longer matches

    damaged = run(engine, prompt=prompt)
    repaired = run(engine, prompt=prompt)

    assert damaged.cached_tokens == 8 and repaired.cached_tokens == 39
    expected = reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])
    assert damaged.output_token_ids == repaired.output_token_ids == expected


def test_chunk_evicted_between_lookup_and_fetch_ends_the_run(tiny_llama):
    cache = InMemoryStore()
    engine = make_engine(tiny_llama, cache=cache, l0_bytes=0)  # what the store gives, not L0's copies
    prompt = text_of_length(40)
    run(engine, prompt=prompt)
    third_key = list(cache._entries)[2]
    cache.fetch = lambda keys, fetch=cache.fetch: ((k, None if k == third_key else b) for k, b in fetch(keys))

    assert run(engine, prompt=prompt).cached_tokens == 16


@pytest.mark.parametrize("bits, most_of_fp16", [(8, 0.75), (4, 0.5)])
def test_quantized_storage_hits_with_fewer_bytes(tiny_llama, bits, most_of_fp16):
    # Against fp16 K/V, not the tiny model's fp32 (which any 16-bit format would halve). head_dim 16 makes
    # the per-group scales weigh heavily: 8-bit stores 0.69 of fp16 here, 4-bit 0.45.
    quantized = make_engine(tiny_llama, kv_cache_bits=bits, max_answer_tokens_stored=0)  # the prompt's chunks
    prompt = text_of_length(40)
    run(quantized, prompt=prompt)
    assert run(quantized, prompt=prompt).cached_tokens == 39
    geometry = kv_geometry(tiny_llama[0].config)
    fp16_bytes = 40 * geometry.num_layers * 2 * geometry.num_kv_heads * geometry.head_dim * 2  # 5 chunks of 8 tokens, K and V
    assert quantized.stats()["chunks_stored"] == 5
    assert quantized.stats()["bytes_stored"] < most_of_fp16 * fp16_bytes


def test_other_namespace_does_not_hit(tiny_llama):
    cache = InMemoryStore()
    prompt = text_of_length(40)
    run(make_engine(tiny_llama, cache=cache, tenant_salt="a"), prompt=prompt)
    assert run(make_engine(tiny_llama, cache=cache, tenant_salt="b"), prompt=prompt).cached_tokens == 0
    assert run(make_engine(tiny_llama, cache=cache, tenant_salt="a"), prompt=prompt).cached_tokens == 39


def test_warm_stores_every_full_chunk(tiny_llama):
    cache = InMemoryStore()
    engine = make_engine(tiny_llama, cache=cache)
    system = text_of_length(30)

    warmed = engine.warm(system)
    outcome = run(engine, prompt=system + " Now a question?")

    assert (warmed.chunks_stored, warmed.token_count, warmed.chunk_size) == (3 + 1, 30, 8)  # and the partial tail
    assert not warmed.chunk_boundary_aligned and warmed.partial_tail_tokens == 6 and warmed.alignment_warning
    assert outcome.cached_tokens == 30  # the whole warmed text: 3 chunks and its 6-token partial tail
    aligned = engine.warm(text_of_length(32))
    assert aligned.chunk_boundary_aligned and aligned.partial_tail_tokens == 0 and aligned.alignment_warning == ""


def test_warm_content_addressed_stores_content_keys(tiny_llama):
    cache = InMemoryStore()
    engine = make_engine(tiny_llama, cache=cache)
    warmed = engine.warm(text_of_length(16), content_addressed=True, pin=True)
    assert warmed.chunks_stored == 2
    assert all(entry.content_key is not None and entry.pin for entry in cache._entries.values())


def test_warm_chat_prefix_is_reused_by_the_next_turn(tiny_llama):
    engine = make_engine(tiny_llama)
    warmed = engine.warm(None, messages=CHAT[:3])
    outcome = run(engine, messages=CHAT)
    assert outcome.cached_tokens == warmed.token_count > 0  # whole chunks and the partial tail chunk


def test_unpin_clears_exactly_the_pins_of_the_same_warm_up(tiny_llama):
    cache = InMemoryStore()
    engine = make_engine(tiny_llama, cache=cache)
    pinned_text, other_text = text_of_length(30), "Another document entirely, " + text_of_length(20)
    engine.warm(pinned_text, pin=True, cache_salt="a")
    engine.warm(other_text, pin=True, cache_salt="a")
    pinned_before = {key for key in cache._entries if cache.pinned(key)}
    assert len(pinned_before) == (3 + 1) + (len(tokenize_prompt(engine.tokenizer, other_text)[0]) + 7) // 8

    assert engine.unpin(pinned_text, cache_salt="b") == (0, 30)  # another scope: none of its keys are stored
    unpinned, token_count = engine.unpin(pinned_text, cache_salt="a")
    assert (unpinned, token_count) == (3 + 1, 30)  # 3 full chunks and the partial tail
    still_pinned = {key for key in cache._entries if cache.pinned(key)}
    assert len(still_pinned) == len(pinned_before) - 4 and still_pinned < pinned_before  # the other text keeps its pins
    assert run(engine, prompt=pinned_text + " Now a question?", cache_salt="a").cached_tokens == 30  # still served
    with pytest.raises(InvalidRequest):
        engine.unpin("")


def test_strict_context_refuses_what_the_default_caps(tiny_llama):
    context = kv_geometry(tiny_llama[0].config).max_context
    engine = make_engine(tiny_llama, max_new_tokens_limit=context)
    prompt = text_of_length(20)
    _, _, capped = engine.plan_request(GenerationParams(prompt=prompt, max_new_tokens=context))
    assert capped == context - 20
    with pytest.raises(InvalidRequest, match=f"the context holds {context} tokens, but {context + 20} were asked for"):
        engine.generate(GenerationParams(prompt=prompt, max_new_tokens=context, strict_context=True))
    fits = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=3, strict_context=True))
    assert fits.generated_tokens == 3


def test_warm_without_text_is_invalid(tiny_llama):
    with pytest.raises(InvalidRequest):
        make_engine(tiny_llama).warm("")


class DropsControlCharacters:
    """SmolLM2's tokenizer gives no token for "\x04" and five other control characters; the tiny one gives one."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __call__(self, text, **kwargs):
        return self._tokenizer(text.replace("\x04", ""), **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_warm_of_a_text_without_tokens_stores_nothing_and_says_so(tiny_llama):
    """Found by the schema fuzzer: such a text is a valid Warm; there is nothing to compute or store, not a 400."""
    cache = InMemoryStore()
    engine = make_engine(tiny_llama, cache=cache)
    engine.parts = dataclasses.replace(engine.parts, tokenizer=DropsControlCharacters(engine.tokenizer))
    warmed = engine.warm("\x04\x04", pin=True)
    assert (warmed.chunks_stored, warmed.token_count, warmed.partial_tail_tokens) == (0, 0, 0) and not cache._entries
    assert engine.warm("\x04", content_addressed=True).chunks_stored == 0
    assert engine.unpin("\x04") == (0, 0)
    assert engine.warm(text_of_length(16)).chunks_stored == 2  # and the engine carries on


# -- streaming, stopping, sampling ---------------------------------------------------------------------


def test_streamed_pieces_concatenate_to_the_output(tiny_llama):
    engine = make_engine(tiny_llama)
    pieces, ids = [], []

    def on_token(event):
        pieces.append(event.text)
        ids.extend(event.token_ids)

    outcome = engine.generate(GenerationParams(prompt="Hello", max_new_tokens=16), on_token=on_token)

    assert "".join(pieces) == outcome.output_text
    assert ids == outcome.output_token_ids and outcome.generated_tokens == 16
    assert outcome.finish_reason == "length" and outcome.ttft_ms > 0 and outcome.total_ms >= outcome.ttft_ms


def test_stop_string_cuts_the_output_before_it(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama)
    free = tokenizer.decode(reference_ids(model, tokenize_prompt(tokenizer, "Hello")[0], max_new_tokens=24))  # plain generate
    stop = next(free[i:i + 2] for i in range(3, len(free)) if "\ufffd" not in free[i:i + 2])
    pieces = []

    outcome = engine.generate(GenerationParams(prompt="Hello", max_new_tokens=24, stop=(stop, "never there")),
                              on_token=lambda event: pieces.append(event.text))

    assert outcome.finish_reason == "stop"
    assert outcome.output_text == free[: free.index(stop)] == "".join(pieces)


def test_eos_ends_generation_like_generate(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(tiny_llama)
    prompt_ids = tokenize_prompt(tokenizer, "Hello")[0]
    eos = reference_ids(model, prompt_ids)[5]  # a token plain greedy decoding reaches: make it the EOS
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        stopped = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=eos)
    expected = stopped[0, len(prompt_ids):].tolist()  # plain transformers, stopped by its own EOS handling
    engine.parts = dataclasses.replace(engine.parts, eos_ids=frozenset({eos}))

    outcome = run(engine, prompt="Hello")

    assert outcome.finish_reason == "eos" and expected[-1] == eos
    assert outcome.output_token_ids == expected


def test_should_stop_cancels(tiny_llama):
    engine = make_engine(tiny_llama)
    seen = []
    outcome = engine.generate(GenerationParams(prompt="Hello", max_new_tokens=50),
                              on_token=lambda event: seen.append(event.token_ids), should_stop=lambda: len(seen) >= 3)
    assert outcome.finish_reason == "cancelled" and outcome.generated_tokens == 3

    before_start = engine.generate(GenerationParams(prompt="Hello"), should_stop=lambda: True)
    assert before_start.finish_reason == "cancelled" and before_start.generated_tokens == 0


def test_sampling_is_reproducible_with_a_seed(tiny_llama):
    engine = make_engine(tiny_llama)
    sampled = [run(engine, prompt="Hello", temperature=1.0, top_p=0.9, top_k=50, seed=seed).output_token_ids
               for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]
    greedy = run(engine, prompt="Hello").output_token_ids
    assert run(engine, prompt="Hello", temperature=0.7, top_k=1, seed=3).output_token_ids == greedy


# -- errors, info, stats, verify -----------------------------------------------------------------------


def test_prompt_over_the_limit_is_refused(tiny_llama):
    engine = make_engine(tiny_llama, max_prompt_tokens=16)
    with pytest.raises(PromptTooLong):
        engine.generate(GenerationParams(prompt=text_of_length(17)))


def test_max_new_tokens_over_the_limit_is_invalid(tiny_llama):
    engine = make_engine(tiny_llama, max_new_tokens_limit=8)
    with pytest.raises(InvalidRequest):
        engine.generate(GenerationParams(prompt="Hello", max_new_tokens=9))


@pytest.mark.parametrize("fields", [
    {},
    {"prompt": ""},
    {"prompt": "a", "segments": ("b",)},
    {"prompt": "a", "max_new_tokens": 0},
    {"prompt": "a", "mode": "fastest"},
    {"prompt": "a", "temperature": float("nan")},
    {"prompt": "a", "temperature": -1.0},
    {"prompt": "a", "top_p": 0.0},
    {"prompt": "a", "top_k": -1},
    {"prompt": "a", "stop": ("",)},
    {"prompt": "a", "recompute_strategy": "all"},
    {"prompt": "a", "recompute_ratio": 1.5},
    {"messages": (("robot", "hi"),)},
])
def test_bad_parameters_are_invalid(fields):
    with pytest.raises(InvalidRequest):
        GenerationParams(**fields)


@pytest.mark.parametrize("l0_bytes", [0, 1 << 20])
def test_model_info_and_stats(tiny_llama, l0_bytes):
    engine = make_engine(tiny_llama, max_answer_tokens_stored=0,  # counts of the prompt's chunks
                         l0_bytes=l0_bytes)
    info = engine.model_info()
    assert (info["num_layers"], info["num_kv_heads"], info["head_dim"], info["chunk_size"]) == (2, 2, 16, 8)
    assert info["dtype"] == "float32" and info["device"] == "cpu" and len(info["namespace_hex"]) == 64
    assert info["default_mode"] == "prefix_cache"
    run(engine, prompt=text_of_length(40))
    run(engine, prompt=text_of_length(40))
    stats = engine.stats()
    assert (stats["requests"], stats["prompt_tokens"], stats["cached_tokens"]) == (2, 80, 39)
    assert stats["chunks_stored"] == 5 and stats["bytes_stored"] > 0 and stats["mean_ttft_ms"] > 0
    # The second request's 5 chunks (40 tokens x 512 B of K/V): from the daemon, or from L0 when it is on.
    assert stats["load_bytes"] == 40 * 512 and stats["load_seconds"] > 0  # all 5 placed; the last token runs again
    if l0_bytes:
        assert (stats["chunks_fetched"], stats["bytes_fetched"]) == (0, 0)
        assert (stats["l0_chunks_hit"], stats["l0_bytes_placed"]) == (5, 40 * 512)
    else:
        assert stats["chunks_fetched"] == 5 and stats["bytes_fetched"] == stats["bytes_stored"]
        assert "l0_chunks_hit" not in stats


def test_namespace_is_stable_and_depends_on_config(tiny_llama):
    assert make_engine(tiny_llama).namespace == make_engine(tiny_llama).namespace
    assert make_engine(tiny_llama).namespace != make_engine(tiny_llama, chunk_size=16).namespace
    assert make_engine(tiny_llama).namespace != make_engine(tiny_llama, kv_cache_bits=8).namespace


def test_verify_reports_identity(tiny_llama):
    engine = make_engine(tiny_llama)
    [report] = engine.verify([text_of_length(40)], max_new_tokens=6)
    assert report["token_identical"] and report["matching_prefix_tokens"] == 6
    assert report["cached_tokens"] == 39
    assert report["first_token_cosine"] == pytest.approx(1.0) and report["first_token_kl"] == pytest.approx(0.0, abs=1e-9)


def test_null_cache_always_misses(tiny_llama):
    engine = make_engine(tiny_llama, cache=NullStore())
    outcomes = [run(engine, prompt=text_of_length(40)) for _ in range(2)]
    assert [o.cached_tokens for o in outcomes] == [0, 0]


# -- test doubles --------------------------------------------------------------------------------------


class RecordingCache(InMemoryStore):
    """Records the order of calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.on_store = lambda: self.calls.append("store")

    def lookup(self, namespace, prefix_keys, content_keys=None, partial_keys=None, continuation=None, after_run=None) -> StoreLookup:
        self.calls.append("lookup")
        return super().lookup(namespace, prefix_keys, content_keys, partial_keys, continuation, after_run)

    def fetch(self, keys):
        self.calls.append("fetch")
        return super().fetch(keys)

    def store(self, items) -> int:
        self.on_store()
        return super().store(items)


class UnreachableCache:
    def __init__(self) -> None:
        self.degraded = True
        self.calls = threading.local()

    def lookup(self, namespace, prefix_keys, content_keys=None, partial_keys=None, continuation=None, after_run=None):
        raise StoreUnavailable("daemon down")

    def fetch(self, keys):
        raise StoreUnavailable("daemon down")

    def store(self, items):
        raise StoreUnavailable("daemon down")
