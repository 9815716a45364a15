"""GenerateBatch / GenerateMany: shared prefix fetched once, left-padded suffixes, per-row decoding.

Every greedy row is checked against plain transformers `model.generate` on that prompt alone.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_service.engine import executor as executor_module
from inference_service.engine.batch import shared_chunk_count
from inference_service.store.protocol import StoreUnavailable
from inference_service.store.memory import InMemoryStore
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.errors import InvalidRequest
from kvboost_keys.prompts import plan_prompt, tokenize_messages, tokenize_prompt
from tests.factories import build_tiny_model

SYSTEM = "The quick brown fox jumps over the lazy dog. " * 2  # 90 byte tokens: 11 chunks of 8 and a tail
QUESTIONS = ["Q1?", "A much longer question here, with padding to spare?", "Mid-sized one?"]
OTHER_SYSTEM = "Pack my box with five dozen liquor jugs, said the sphinx. "


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def tiny_model(request):
    return request.getfixturevalue(request.param)


class CountingCache(InMemoryStore):
    """An InMemoryStore that records every fetch call's keys."""

    def __init__(self) -> None:
        super().__init__()
        self.fetches: list[list[bytes]] = []

    def fetch(self, keys):
        self.fetches.append(list(keys))
        return super().fetch(keys)


def make_engine(model, tokenizer, chunk_size=8, cache=None) -> Engine:
    """l0_bytes=0: these tests count the store's fetches, which L0 would spare."""
    cache = InMemoryStore() if cache is None else cache
    return Engine(model, tokenizer, EngineConfig(chunk_size=chunk_size, l0_bytes=0), cache, model_id="batch-test")


def reference_ids(model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain transformers greedy generation of one prompt alone: the ground truth."""
    input_ids = torch.tensor([token_ids])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens)
    return output[0, len(token_ids):].tolist()


def prompt_references(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    return [reference_ids(model, tokenize_prompt(tokenizer, p)[0], max_new_tokens) for p in prompts]


def params(prompts, mode="prefix_cache", max_new_tokens=10, **fields) -> list[GenerationParams]:
    return [GenerationParams(prompt=p, mode=mode, max_new_tokens=max_new_tokens, request_id=f"r{i}", **fields)
            for i, p in enumerate(prompts)]


def ids_of(outcomes) -> list[list[int]]:
    return [o.output_token_ids for o in outcomes]


# -- the shared run of chunks (pure) ------------------------------------------------------------------

def test_shared_chunk_count_stops_at_the_first_different_chunk_and_before_the_last_token():
    def plan(tokens):
        return plan_prompt(bytes(32), [tokens], 4)

    base = list(range(12))
    # 12 and 14 tokens agreeing on 3 chunks: the last chunk of the 12-token prompt holds its last token.
    assert shared_chunk_count([plan(base), plan(base + [50, 51])]) == 2
    assert shared_chunk_count([plan(base + [1]), plan(base + [50, 51])]) == 3
    # A change in chunk 1 ends the run there; a prompt shorter than a chunk shares nothing.
    assert shared_chunk_count([plan(base + [1]), plan(base[:5] + [99] + base[6:] + [1])]) == 1
    assert shared_chunk_count([plan(base + [1]), plan([0, 1])]) == 0


# -- identity with plain model.generate ---------------------------------------------------------------

@pytest.mark.parametrize("mode", ["baseline", "prefix_cache", "chunk_kv_reuse"])
def test_batch_is_token_identical_to_generate_uncached_then_cached(tiny_model, mode):
    model, tokenizer = tiny_model
    engine = make_engine(model, tokenizer)
    prompts = [SYSTEM + q for q in QUESTIONS]  # suffixes of 5, 52 and 16 tokens: real left padding
    expected = prompt_references(model, tokenizer, prompts, 10)

    first = engine.generate_batch(params(prompts, mode))
    engine.flush_writes()
    second = engine.generate_batch(params(prompts, mode))

    assert ids_of(first) == ids_of(second) == expected
    assert [o.cached_tokens for o in first] == [0, 0, 0]
    shared = 0 if mode == "baseline" else 88  # 11 chunks of 8 are shared and were written back once
    # The first row looks its whole prompt up (it prefills the shared chunks for the others) and also finds 4
    # tokens of the partial tail the first call stored; the others copy the shared chunks from its slot.
    assert [o.cached_tokens for o in second] == [0 if mode == "baseline" else 92, shared, shared]
    assert [o.prompt_tokens for o in second] == [len(p) for p in prompts]
    assert [o.kv_reuse_ratio for o in second] == pytest.approx([o.cached_tokens / len(p) for o, p in zip(second, prompts)])
    assert all(o.mode == mode and o.finish_reason == "length" and o.ttft_ms > 0 for o in second)
    assert [o.request_id for o in second] == ["r0", "r1", "r2"]


def test_rows_finish_on_their_own_at_eos_or_length(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(model, tokenizer)
    prompts = [SYSTEM + q for q in QUESTIONS]
    greedy = prompt_references(model, tokenizer, prompts, 16)
    # An "EOS" that row 0 emits after a few tokens and row 1 never does within 16.
    eos = next(t for i, t in enumerate(greedy[0]) if i >= 3 and t not in greedy[0][:i] and t not in greedy[1])
    engine.parts = dataclasses.replace(engine.parts, eos_ids=frozenset({eos}))
    limits = [16, 16, 5]

    outcomes = engine.generate_batch([GenerationParams(prompt=p, max_new_tokens=n, mode="prefix_cache")
                                       for p, n in zip(prompts, limits)])

    expected = []
    for prompt, limit in zip(prompts, limits):
        input_ids = torch.tensor([tokenize_prompt(tokenizer, prompt)[0]])
        with torch.inference_mode():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                    max_new_tokens=limit, eos_token_id=eos)
        expected.append(output[0, input_ids.shape[1]:].tolist())
    assert ids_of(outcomes) == expected
    assert [o.finish_reason for o in outcomes] == ["eos", "length", "length"]
    assert outcomes[0].output_token_ids[-1] == eos and len(outcomes[0].output_token_ids) < 16


def test_cancellation_stops_every_row(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(model, tokenizer)
    prompts = [SYSTEM + q for q in QUESTIONS]
    calls = []

    def stop_after_three_tokens() -> bool:  # polled once per row before it starts, then once per row and token
        calls.append(1)
        return len(calls) > len(prompts) + 3 * len(prompts)

    before_start = engine.generate_batch(params(prompts), should_stop=lambda: True)
    midway = engine.generate_batch(params(prompts, max_new_tokens=50), should_stop=stop_after_three_tokens)

    assert [(o.finish_reason, o.generated_tokens) for o in before_start] == [("cancelled", 0)] * 3
    assert [o.finish_reason for o in midway] == ["cancelled"] * 3
    # Polled once per row at admission, then once per row and token; the first row (which prefills the shared
    # chunks) joins one step before the others, which copy them and then prefill their own suffixes.
    assert [o.generated_tokens for o in midway] == [5, 4, 3]


def test_an_unreachable_cache_serves_the_batch_degraded(tiny_llama):
    model, tokenizer = tiny_llama

    class UnreachableCache(InMemoryStore):
        def lookup(self, *args, **kwargs):
            raise StoreUnavailable("down")

    engine = make_engine(model, tokenizer, cache=UnreachableCache())
    prompts = [SYSTEM + q for q in QUESTIONS]

    outcomes = engine.generate_batch(params(prompts))
    engine.flush_writes()

    assert ids_of(outcomes) == prompt_references(model, tokenizer, prompts, 10)
    assert [(o.degraded, o.cached_tokens) for o in outcomes] == [(True, 0)] * 3
    assert engine.stats()["chunks_stored"] == 0


def test_pads_are_masked_out(tiny_qwen2):
    model, tokenizer = tiny_qwen2
    engine = make_engine(model, tokenizer)
    prompts = [SYSTEM + q for q in QUESTIONS]

    runs = [ids_of(engine.generate_batch(params(prompts, "baseline"), pad_token_id=pad)) for pad in (0, 65, 258)]

    assert runs[0] == runs[1] == runs[2] == prompt_references(model, tokenizer, prompts, 10)


def test_the_shared_prefix_is_fetched_once_for_the_batch(tiny_llama):
    model, tokenizer = tiny_llama
    cache = CountingCache()
    engine = make_engine(model, tokenizer, cache=cache)
    warmed = engine.warm(SYSTEM)
    prompts = [SYSTEM + q for q in QUESTIONS]

    outcomes = engine.generate_batch(params(prompts))

    assert warmed.chunks_stored == 11 + 1  # 11 whole chunks, then the 2 tail tokens as a partial chunk
    assert len(cache.fetches) == 1  # one Fetch for three rows: the first row's, the others copy its shared chunks
    system = plan_prompt(engine.namespace, tokenize_prompt(tokenizer, SYSTEM), 8)
    assert cache.fetches[0] == list(system.prefix_keys) + [system.tail_key]  # the first row continues the warmed tail
    assert [o.cached_tokens for o in outcomes] == [90, 88, 88]
    stats = engine.stats()
    assert (stats["requests"], stats["chunks_fetched"], stats["cached_tokens"]) == (3, 12, 90 + 2 * 88)
    assert ids_of(outcomes) == prompt_references(model, tokenizer, prompts, 10)


def test_sampling_rows_keep_their_own_seeded_stream(tiny_llama):
    model, tokenizer = tiny_llama
    engine = make_engine(model, tokenizer)
    prompts = [SYSTEM + q for q in QUESTIONS]
    sampled = GenerationParams(prompt=prompts[0], max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=7)

    alongside_two = engine.generate_batch([sampled] + params(prompts[1:], "chunk_kv_reuse"))
    alongside_one = engine.generate_batch([sampled, params(prompts[2:], "chunk_kv_reuse")[0]])

    # The seeded row draws the same tokens whatever its companions; greedy rows still match generate.
    assert alongside_two[0].output_token_ids == alongside_one[0].output_token_ids
    assert ids_of(alongside_two[1:]) == prompt_references(model, tokenizer, prompts[1:], 10)


def test_a_row_of_another_mode_keeps_it_and_the_others_share_one_fetch(tiny_llama):
    model, tokenizer = tiny_llama
    cache = CountingCache()
    engine = make_engine(model, tokenizer, cache=cache)
    engine.warm(SYSTEM)
    prompts = [SYSTEM + q for q in QUESTIONS]
    requests = params(prompts[:2]) + [GenerationParams(prompt=prompts[2], mode="baseline", max_new_tokens=10,
                                                       request_id="r2")]

    outcomes = engine.generate_batch(requests)

    assert [o.mode for o in outcomes] == ["prefix_cache", "prefix_cache", "baseline"]
    assert [o.cached_tokens for o in outcomes] == [90, 88, 0]  # the first also continues the warmed tail
    assert len(cache.fetches) == 1  # the two prefix_cache rows' shared chunks; the baseline row reads nothing
    assert ids_of(outcomes) == prompt_references(model, tokenizer, prompts, 10)


def test_a_row_with_content_hits_is_repaired_on_its_own_and_the_others_share(tiny_llama):
    model, tokenizer = tiny_llama
    cache = CountingCache()
    engine = make_engine(model, tokenizer, cache=cache)
    document = "Pack my box with five dozen liquor jugs!!"  # 41 bytes: 5 chunks of 8 and a tail
    engine.warm(document, content_addressed=True)
    requests = [GenerationParams(segments=(SYSTEM[:16], document, "Why?"), mode="chunk_kv_reuse", request_id="doc")]
    requests += params([SYSTEM + q for q in QUESTIONS[:2]], "chunk_kv_reuse")

    outcomes = engine.generate_batch(requests)

    assert [o.request_id for o in outcomes] == ["doc", "r0", "r1"]
    # The document row found its chunks by content and repaired them (per prompt); the other two share a
    # prefix the store does not hold, computed once for both.
    assert (outcomes[0].cached_tokens, outcomes[0].recomputed_tokens > 0) == (41, True)
    assert [o.cached_tokens for o in outcomes[1:]] == [0, 0]
    assert len(cache.fetches) == 1  # the document row's content hits
    assert ids_of(outcomes[1:]) == prompt_references(model, tokenizer, [SYSTEM + q for q in QUESTIONS[:2]], 10)


def test_a_sliding_window_model_runs_every_row_alone(monkeypatch):
    model, tokenizer = build_tiny_model("mistral_sliding")
    engine = make_engine(model, tokenizer)
    prompts = [SYSTEM + q for q in QUESTIONS]
    decoded_alone = []
    original = executor_module.decode_alone
    monkeypatch.setattr(executor_module, "decode_alone",
                        lambda *args: decoded_alone.append(1) or original(*args))

    outcomes = engine.generate_batch(params(prompts))

    # Pads would shift the window: each row decodes in a forward of its own, its prefill runs alone.
    assert not engine.core.executor.batched and not engine.core.scheduler.limits.batch_prefills
    assert len(decoded_alone) == 3 * 9
    assert ids_of(outcomes) == prompt_references(model, tokenizer, prompts, 10)


def test_generate_many_keeps_the_input_order_over_mixed_groups(tiny_qwen2):
    model, tokenizer = tiny_qwen2
    cache = CountingCache()
    engine = make_engine(model, tokenizer, cache=cache)
    engine.warm(SYSTEM)
    engine.warm(OTHER_SYSTEM)
    prompts = [SYSTEM + QUESTIONS[0], OTHER_SYSTEM + "Why?", "short", SYSTEM + QUESTIONS[1],
               OTHER_SYSTEM + "And how, exactly?", "tiny", SYSTEM + QUESTIONS[2]]

    outcomes = engine.generate_many(params(prompts, max_new_tokens=6))

    assert [o.request_id for o in outcomes] == [f"r{i}" for i in range(7)]
    assert ids_of(outcomes) == prompt_references(model, tokenizer, prompts, 6)
    # Each group's first row also continues its warmed system prompt's partial tail (90 of 88 + 2, 58 of 56 + 2).
    assert [o.cached_tokens for o in outcomes] == [90, 58, 0, 88, 56, 0, 88]
    assert len(cache.fetches) == 2  # one per system prompt; the two short prompts share nothing


def test_an_empty_or_malformed_batch_is_invalid(tiny_llama):
    engine = make_engine(*tiny_llama)
    with pytest.raises(InvalidRequest, match="at least one request"):
        engine.generate_batch([])
    with pytest.raises(InvalidRequest, match="at least one request"):
        engine.generate_many([])
    with pytest.raises(InvalidRequest, match=r"^requests\[1\]: max_new_tokens 5000 is over the server's limit"):
        engine.generate_batch([GenerationParams(prompt="fine"), GenerationParams(prompt="long", max_new_tokens=5000)])


# -- the real SmolLM2 ---------------------------------------------------------------------------------

SMOL_SYSTEM = ("You are a careful assistant for a hardware store. You answer questions about tools, paint, garden "
               "supplies and plumbing in two short sentences. You never invent prices or stock levels, and when a "
               "question is unclear you say which detail is missing before you answer. Safety comes first: mention gloves, "
               "goggles or a dust mask whenever a job needs them, and suggest a professional for gas or mains work.")
SMOL_QUESTIONS = ["Which drill for concrete?",
                  "I need to repaint a small bathroom ceiling that gets a lot of steam every morning; which kind of "
                  "paint should I pick, and do I need a primer first?",
                  "How do I fix a dripping kitchen tap?"]


@pytest.mark.slow
def test_smollm2_chat_batch_is_token_identical_uncached_cached_and_baseline(smollm2):
    model, tokenizer, _ = smollm2
    engine = make_engine(model, tokenizer, chunk_size=16)
    chats = [(("system", SMOL_SYSTEM), ("user", q)) for q in SMOL_QUESTIONS]
    token_ids = [tokenize_messages(tokenizer, chat)[0] for chat in chats]
    expected = [reference_ids(model, ids, 12) for ids in token_ids]
    # Row 2 stops at the first word of its answer's second half; row 0 ends early by length.
    stop = tokenizer.decode(expected[2][6:]).split()[0]
    num_to_stop = next(k for k in range(1, 13) if stop in tokenizer.decode(expected[2][:k]))

    def requests(mode, limits=(12, 12, 12), stop_row_2=()):
        return [GenerationParams(messages=chat, max_new_tokens=limit, mode=mode, stop=stop_row_2 if i == 2 else ())
                for i, (chat, limit) in enumerate(zip(chats, limits))]

    uncached = engine.generate_batch(requests("prefix_cache"))
    engine.flush_writes()
    cached = engine.generate_batch(requests("prefix_cache", limits=(4, 12, 12), stop_row_2=(stop,)))
    baseline = engine.generate_batch(requests("baseline"))

    common = next(i for i, column in enumerate(zip(*token_ids)) if len(set(column)) > 1)
    assert len({len(ids) for ids in token_ids}) == 3  # three suffix lengths: rows are padded
    assert common // 16 >= 5  # the system prompt spans several chunks
    assert ids_of(uncached) == ids_of(baseline) == expected
    assert [o.cached_tokens for o in uncached] == [0, 0, 0]
    # The first row looks its whole prompt up (the others copy the shared chunks from it) and finds the partial
    # tail its own first call stored: all but its last token.
    assert [o.cached_tokens for o in cached] == [len(token_ids[0]) - 1] + [common // 16 * 16] * 2
    assert ids_of(cached) == [expected[0][:4], expected[1], expected[2][:num_to_stop]]
    assert [o.finish_reason for o in cached] == ["length", "length", "stop"]
    full_text = tokenizer.decode(expected[2], skip_special_tokens=True)
    assert cached[2].output_text == full_text[: full_text.index(stop)]
    assert cached[1].output_text == tokenizer.decode(expected[1], skip_special_tokens=True)


# -- through the gRPC servicer ------------------------------------------------------------------------

def _batch_request(prompts):
    from kvboost.v1 import inference_pb2 as pb

    return pb.GenerateBatchRequest(requests=[
        pb.GenerateRequest(prompt=p, max_new_tokens=10, mode=pb.PREFIX_CACHE, request_id=f"r{i}")
        for i, p in enumerate(prompts)])


def test_generate_batch_and_many_over_grpc_join_the_running_batch_beside_a_stream(tiny_llama):
    """The calls' rows go to the engine's one step loop, beside a Generate stream already decoding there;
    GenerateMany's rows with a common first chunk share one prefill of it (a source and its followers)."""
    from kvboost.v1 import inference_pb2 as pb
    from tests.inference_service.serving.test_servicer import run, serving

    model, tokenizer = tiny_llama
    engine = make_engine(model, tokenizer)  # chunk 8, as the servicer tests' server config
    prompts = [SYSTEM + q for q in QUESTIONS] + ["short one"]
    stream_prompt = "A stream that is decoding while the batches arrive."

    async def scenario():
        async with serving(engine) as (server, stub, _health):
            core = engine.core
            submitted, running = [], []
            submit, step = core.submit, core.step
            core.submit = lambda seqs: [submitted.append((seq.request_id, seq.source is not None))
                                        for seq in seqs] and submit(seqs)
            core.step = lambda: step() or running.append(core.scheduler.num_running_rows)
            stream = stub.Generate(pb.GenerateRequest(prompt=stream_prompt, max_new_tokens=150, request_id="stream"),
                                   timeout=60)
            streamed = []
            async for event in stream:  # decoding has started
                streamed += list(event.token_ids)
                break
            batch = await stub.GenerateBatch(_batch_request(prompts), timeout=60)
            many = await stub.GenerateMany(_batch_request(prompts), timeout=60)
            async for event in stream:
                streamed += list(event.token_ids)
            return batch, many, submitted, max(running), streamed

    try:
        batch, many, submitted, most_running, streamed = run(scenario())
    finally:
        engine.close()
    expected = prompt_references(model, tokenizer, prompts, 10)
    for reply in (batch, many):
        assert [r.request_id for r in reply.results] == ["r0", "r1", "r2", "r3"]
        assert [list(r.output_token_ids) for r in reply.results] == expected
        assert all(r.mode == pb.PREFIX_CACHE and r.finish_reason == "length" for r in reply.results)
    # GenerateBatch's prompts share no whole chunk ("short one" differs at once); GenerateMany groups the
    # three with the same first chunk (r0 prefills it, r1 and r2 copy it) and leaves the short prompt alone.
    rows = [(f"r{i}", False) for i in range(4)] + [("r0", False), ("r1", True), ("r2", True), ("r3", False)]
    assert submitted == [("stream", False)] + rows
    assert most_running >= 5  # the stream and a call's four rows decoded in the same steps
    assert streamed == reference_ids(model, tokenize_prompt(tokenizer, stream_prompt)[0], 150)


def test_an_empty_batch_over_grpc_is_invalid_argument(tiny_llama):
    import grpc

    from kvboost.v1 import inference_pb2 as pb
    from tests.inference_service.serving.test_servicer import run, serving

    engine = make_engine(*tiny_llama)

    async def scenario():
        errors = []
        async with serving(engine) as (_, stub, _health):
            for method in (stub.GenerateBatch, stub.GenerateMany):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await method(pb.GenerateBatchRequest(), timeout=10)
                errors.append(raised.value)
        return errors

    try:
        errors = run(scenario())
    finally:
        engine.close()
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert [e.details() for e in errors] == ["GenerateBatch needs at least one request in `requests`",
                                             "GenerateMany needs at least one request in `requests`"]
