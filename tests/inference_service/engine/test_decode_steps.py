"""The engine's decode steps and dtypes against plain transformers `model.generate` (its default attention).

float32: every path (one request, batched rows, prefixes from the cache, rows joining a running batch) is
token-identical. bfloat16/float16 keep what docs/engine.md's standard promises there, and nothing that depends on
which kernels the CPU selects: the default path answers a request the same way run after run; the invariant path
(--invariant-prefill) answers it bitwise the same cached or not, and a batched row's first token is its own. Agreement
with `model.generate` in half precision is measured and recorded (`record_property`), not asserted: on a CPU with
AVX512-FP16 the batched fp16 rows agree 0.83, elsewhere 1.0, with the same code.
"""
from __future__ import annotations

import threading

import pytest
import torch

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from kvboost_keys.prompts import tokenize_prompt
from inference_service.store.memory import InMemoryStore
from tests.factories import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SYSTEM = "You answer questions about the harbour, its boats and its tides. " * 2  # several chunks of 16
PROMPTS = [SYSTEM + question for question in ("When?", "Which boats leave first on a windy morning?", "Why so?")]
MAX_NEW_TOKENS = 12


def tiny(kind: str, dtype: torch.dtype):
    """A tiny model whose matrices are redrawn 10x larger than the fixtures': its greedy outputs depend on the
    prompt and its logits sit close enough that a rounding difference shows (bfloat16 changes its outputs)."""
    model, tokenizer = build_tiny_model(kind)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model.to(dtype), tokenizer


def reference_ids(model, tokenizer, prompt: str) -> list[int]:
    token_ids = tokenize_prompt(tokenizer, prompt)[0]
    input_ids = torch.tensor([token_ids])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=MAX_NEW_TOKENS)
    return output[0, len(token_ids):].tolist()


def requests(mode: str = "prefix_cache") -> list[GenerationParams]:
    return [GenerationParams(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, mode=mode, request_id=f"r{index}")
            for index, prompt in enumerate(PROMPTS)]


def together(engine: Engine, params: list[GenerationParams]) -> list[list[int]]:
    """The requests submitted at once (one decode step for all of their rows); their tokens in input order."""
    results: dict[int, object] = {}
    done = threading.Event()

    def on_done_for(index):
        def on_done(outcomes, error):
            results[index] = error or outcomes[0].output_token_ids
            if len(results) == len(params):
                done.set()
        return on_done

    for index, request in enumerate(params):
        engine.submit(request, None, lambda: False, on_done_for(index))
    assert done.wait(120), "the requests did not finish"
    return [results[index] for index in range(len(params))]


def agreement(expected: list[list[int]], got: list[list[int]]) -> float:
    pairs = [(a, b) for want, have in zip(expected, got) for a, b in zip(want, have + [None] * len(want))]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_float32_every_path_through_the_lean_step_is_token_identical_to_generate(kind):
    step = "lean"
    model, tokenizer = tiny(kind, torch.float32)
    expected = [reference_ids(model, tokenizer, prompt) for prompt in PROMPTS]
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=16, decode_step=step), InMemoryStore(),
                    model_id=f"steps-{kind}-{step}")
    try:
        assert engine.stats()["decode_step"] == step  # not silently the model's forward
        alone = [engine.generate(request).output_token_ids for request in requests()]  # misses, then written back
        engine.flush_writes()
        cached = [engine.generate(request) for request in requests()]
        assert all(outcome.cached_tokens > 0 for outcome in cached)
        batch = engine.generate_batch(requests())
        joined = together(engine, requests())  # prefixes from the cache, rows in one running batch
        baseline = together(engine, requests("baseline"))
    finally:
        engine.stop(30)
    assert alone == [outcome.output_token_ids for outcome in cached] == expected
    assert [outcome.output_token_ids for outcome in batch] == joined == baseline == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_half_precision_keeps_the_standard_and_measures_agreement_with_generate(kind, dtype, record_property):
    model, tokenizer = tiny(kind, dtype)
    expected = [reference_ids(model, tokenizer, prompt) for prompt in PROMPTS]
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=16), InMemoryStore(), model_id=f"steps-{kind}-{dtype}")
    try:
        assert engine.stats()["decode_step"] == "lean" and engine.dtype == dtype
        alone = [engine.generate(request).output_token_ids for request in requests("baseline")]
        again = [engine.generate(request).output_token_ids for request in requests("baseline")]
        rows = together(engine, requests("baseline"))
    finally:
        engine.stop(30)
    assert alone == again  # the default path: the same request on the same path, the same answer
    record_property("agreement_alone_with_generate", agreement(expected, alone))
    record_property("agreement_batched_with_generate", agreement(expected, rows))

    engine = Engine(model, tokenizer, EngineConfig(chunk_size=16, invariant_prefill=True), InMemoryStore(),
                    model_id=f"steps-{kind}-{dtype}-invariant")
    try:
        uncached = [engine.generate_with_first_logits(request) for request in requests("baseline")]
        engine.generate(requests()[0])  # stores the system prompt's chunks
        engine.flush_writes()
        cached = [engine.generate_with_first_logits(request) for request in requests()]
        rows = together(engine, requests())
    finally:
        engine.stop(30)
    assert all(outcome.cached_tokens > 0 for outcome, _ in cached), "the invariant answers came from the cache"
    for (want, want_logits), (got, got_logits) in zip(uncached, cached):  # bitwise, cached or not
        assert got.output_token_ids == want.output_token_ids and torch.equal(got_logits, want_logits)
    # A row's prefill runs in forwards of its own, so its first token is its own; its later tokens come from decode
    # steps shared with the other rows, which a CPU's kernels may round with the batch (CUDA only pads them).
    assert [row[0] for row in rows] == [outcome.output_token_ids[0] for outcome, _ in uncached]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_invariant_decode_step_answers_a_batched_row_bitwise_as_alone(kind, dtype):
    """invariant_decode (CUDA's default with invariant prefill in half precision; forced here on the CPU): every slot
    runs as a row and attention goes block by block, so rows decoded beside others, joining a running batch, or
    after a cached prefix give the tokens they give alone, at the dtype where the lean step's rows do not (fp16
    batched rows agree 0.83 with the alone answers on an AVX512-FP16 CPU)."""
    model, tokenizer = tiny(kind, dtype)
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=16, invariant_prefill=True, invariant_decode=True),
                    InMemoryStore(), model_id=f"steps-{kind}-{dtype}-invariant-decode")
    try:
        assert engine.stats()["decode_step"] == "lean+invariant"
        alone = [engine.generate_with_first_logits(request) for request in requests("baseline")]
        rows = together(engine, requests("baseline"))
        engine.generate(requests()[0])
        engine.flush_writes()
        cached_rows = together(engine, requests())
        batch = engine.generate_batch(requests())
    finally:
        engine.stop(30)
    expected = [outcome.output_token_ids for outcome, _ in alone]
    assert rows == cached_rows == [outcome.output_token_ids for outcome in batch] == expected


def test_invariant_decode_without_invariant_prefill_is_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="turn on invariant_prefill"):
        EngineConfig(invariant_decode=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_transformers_step_is_identical_too(kind):
    model, tokenizer = tiny(kind, torch.float32)
    expected = [reference_ids(model, tokenizer, prompt) for prompt in PROMPTS]
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=16, decode_step="transformers"), InMemoryStore(),
                    model_id=f"steps-{kind}-transformers")
    try:
        assert engine.stats()["decode_step"] == "transformers"
        assert together(engine, requests("baseline")) == expected
    finally:
        engine.stop(30)
