"""Engine in CHUNK_KV_REUSE mode: documents warmed alone hit by content inside new prompts, repaired per request."""
from __future__ import annotations

import dataclasses

import pytest

from inference_service.model.attention import ENGINE_ATTENTION
from inference_service.serving import proto_convert as convert
from inference_service.engine import engine as engine_module
from inference_service.engine.engine import GenerationParams
from kvboost_keys.prompts import tokenize_segments
from kvboost.v1 import inference_pb2 as pb
from tests.inference_service.engine.test_engine import make_engine, reference_ids, run

HEADER = "<|im_start|>system\nAnswer from the notes.<|im_end|>\n<|im_start|>user\n"
DOC_A = "Note one: the lighthouse keeper is Ada Finch and the door is blue. "  # 67 bytes: 8 chunks + 3
DOC_B = "Note two: the mill has a red roof and a slow wheel. "  # 52 bytes: 6 chunks + 4
QUESTION = "Name him or her.<|im_end|>\n<|im_start|>assistant\n"  # shares no chunk with the documents
SEGMENTS = (HEADER, DOC_B, DOC_A, QUESTION)
CHUNK_SIZE = 8


def content_engine(model_and_tokenizer, **config):
    """An engine with both documents warmed alone (content-addressed), the header not stored."""
    engine = make_engine(model_and_tokenizer, chunk_size=CHUNK_SIZE, **config)
    for document in (DOC_A, DOC_B):
        engine.warm(document, content_addressed=True)
    return engine


def prompt_ids(tokenizer) -> list[int]:
    return [token for segment in tokenize_segments(tokenizer, SEGMENTS) for token in segment]


def document_tokens(tokenizer) -> int:
    """Tokens of both documents, partial last chunks included: what content hits can cover."""
    return sum(len(tokenizer(document, add_special_tokens=False)["input_ids"]) for document in (DOC_A, DOC_B))


def test_content_addressed_warm_stores_the_partial_last_chunk(tiny_llama):
    engine = make_engine(tiny_llama, chunk_size=CHUNK_SIZE)
    warmed = engine.warm(DOC_B, content_addressed=True)  # 52 tokens: 6 full chunks and 4 tokens
    assert (warmed.chunks_stored, warmed.partial_tail_tokens, warmed.alignment_warning) == (7, 0, "")


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("bits", [16, 8])
def test_cacheblend_at_full_ratio_equals_model_generate(fixture, bits, request):
    """Recomputing every content-hit token in every layer must give plain generate's output, so the
    placement, re-rotation and splicing around the hits are right."""
    model_and_tokenizer = request.getfixturevalue(fixture)
    engine = content_engine(model_and_tokenizer, kv_cache_bits=bits)
    outcome = run(engine, segments=SEGMENTS, mode="chunk_kv_reuse", recompute_strategy="cacheblend",
                  recompute_ratio=1.0)
    tokenizer = model_and_tokenizer[1]
    assert outcome.cached_tokens == document_tokens(tokenizer)
    assert outcome.recomputed_tokens == outcome.cached_tokens
    assert outcome.output_token_ids == reference_ids(model_and_tokenizer[0], prompt_ids(tokenizer))


def test_none_reuses_content_hits_as_they_are(tiny_llama):
    engine = content_engine(tiny_llama)
    outcome = run(engine, segments=SEGMENTS, mode="chunk_kv_reuse", recompute_strategy="none")
    assert outcome.cached_tokens == document_tokens(tiny_llama[1])
    assert outcome.recomputed_tokens == 0
    assert engine.stats()["bytes_fetched"] > 0


def test_selective_recomputes_the_tokens_after_each_seam(tiny_llama):
    engine = content_engine(tiny_llama)
    outcome = run(engine, segments=SEGMENTS, mode="chunk_kv_reuse", recompute_strategy="selective",
                  selective_tokens=3)
    # Two stored runs (document B, then document A), each entered from a non-cached token: two seams.
    assert outcome.recomputed_tokens == 2 * 3
    assert outcome.cached_tokens == document_tokens(tiny_llama[1])


def test_cacheblend_recomputes_its_ratio_of_the_content_hit_tokens(tiny_llama):
    engine = content_engine(tiny_llama)
    outcome = run(engine, segments=SEGMENTS, mode="chunk_kv_reuse", recompute_strategy="cacheblend",
                  recompute_ratio=0.25)
    assert outcome.recomputed_tokens == round(0.25 * document_tokens(tiny_llama[1]))


def test_sink_tokens_recompute_content_hits_at_the_start_of_the_prompt(tiny_llama):
    # A 4-token header, then document B from position 4: sinks 4..15 fall on its content-hit tokens.
    # (A document at position 0 is an exact prefix hit: its content key is its prefix key there.)
    segments = ("Hi: ", DOC_B, DOC_A, QUESTION)
    without, with_sinks = (
        run(content_engine(tiny_llama), segments=segments, mode="chunk_kv_reuse", recompute_strategy="cacheblend",
            recompute_ratio=0.1, sink_tokens=sinks)
        for sinks in (0, 16)
    )
    assert without.cached_tokens == with_sinks.cached_tokens == document_tokens(tiny_llama[1])
    # The 12 sinks are added to cacheblend's own choice, which may already hold some of them.
    assert without.recomputed_tokens < with_sinks.recomputed_tokens <= without.recomputed_tokens + 12


def test_overlap_tokens_are_recomputed_at_the_start_of_every_run(tiny_llama):
    plain = run(content_engine(tiny_llama), segments=SEGMENTS, mode="chunk_kv_reuse", recompute_strategy="none")
    overlapped = run(content_engine(tiny_llama, overlap_tokens=2), segments=SEGMENTS, mode="chunk_kv_reuse",
                     recompute_strategy="none")
    assert overlapped.cached_tokens == plain.cached_tokens - 2 * 2  # two runs, two fresh tokens each
    assert overlapped.recomputed_tokens == 0


def test_server_default_strategy_applies_when_the_request_names_none(tiny_llama):
    engine = content_engine(tiny_llama, default_recompute_strategy="none")
    assert run(engine, segments=SEGMENTS, mode="chunk_kv_reuse").recomputed_tokens == 0
    selective = run(engine, segments=SEGMENTS, mode="chunk_kv_reuse", recompute_strategy="selective",
                    selective_tokens=2)
    assert selective.recomputed_tokens == 2 * 2


def test_prefix_cache_mode_ignores_content_hits(tiny_llama):
    engine = content_engine(tiny_llama)
    outcome = run(engine, segments=SEGMENTS, mode="prefix_cache")
    assert outcome.cached_tokens == 0
    assert outcome.output_token_ids == reference_ids(tiny_llama[0], prompt_ids(tiny_llama[1]))


def test_a_request_that_used_content_hits_stores_nothing(tiny_llama):
    """Its K/V after the first content hit attended to approximate ones, and even those before it came through
    the repair's forward (close to the model's own, not bitwise): stored under prefix keys, they would change a
    later exact answer. So the same prompt by prefix finds nothing of it, and equals plain generate."""
    engine = content_engine(tiny_llama)
    num_entries = len(engine.store)
    opted = run(engine, segments=SEGMENTS, mode="chunk_kv_reuse", recompute_strategy="none")
    assert opted.approximate and len(engine.store) == num_entries
    again = run(engine, segments=SEGMENTS, mode="prefix_cache")
    assert again.cached_tokens == 0 and not again.approximate
    assert again.output_token_ids == reference_ids(tiny_llama[0], prompt_ids(tiny_llama[1]))


def test_model_without_usable_rope_falls_back_to_prefix_reuse(tiny_llama):
    engine = content_engine(tiny_llama)
    engine.parts = dataclasses.replace(engine.parts, content_rope=None)  # as for a model whose RoPE variant cannot be re-rotated
    outcome = run(engine, segments=SEGMENTS, mode="chunk_kv_reuse")
    assert outcome.cached_tokens == 0
    assert outcome.output_token_ids == reference_ids(tiny_llama[0], prompt_ids(tiny_llama[1]))


def test_request_fields_reach_the_repair_options(tiny_llama):
    engine = make_engine(tiny_llama, recompute_ratio=0.3, selective_tokens=5, sink_tokens=1)
    request = pb.GenerateRequest(segments=["a", "b"], recompute_strategy=pb.CACHEBLEND, recompute_ratio=0.5,
                                 sink_tokens=7)
    options = engine.repair_options(convert.generation_params(request))
    assert (options.strategy, options.recompute_ratio, options.selective_tokens, options.sink_tokens) == (
        "cacheblend", 0.5, 5, 7)
    defaults = engine.repair_options(GenerationParams(prompt="x"))
    assert (defaults.strategy, defaults.recompute_ratio, defaults.selective_tokens, defaults.sink_tokens) == (
        "selective", pytest.approx(0.3), 5, 1)


def test_attention_without_a_4d_mask_falls_back_to_prefix_reuse(tiny_llama, monkeypatch):
    """Repair needs attention that takes an arbitrary mask; with another implementation content hits
    are not reused (prefix reuse only), instead of failing the request."""
    model, _ = tiny_llama
    assert model.config._attn_implementation in ("sdpa", ENGINE_ATTENTION)  # the engine selects ours per call
    monkeypatch.setattr(engine_module, "MASKABLE_ATTENTION", ("eager",))  # as if the model's were unsupported
    engine = content_engine(tiny_llama)
    assert engine.parts.content_rope is None
    outcome = run(engine, segments=SEGMENTS, mode="chunk_kv_reuse")
    assert outcome.cached_tokens == 0
    assert outcome.output_token_ids == reference_ids(model, prompt_ids(tiny_llama[1]))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_the_fidelity_guard_reports_and_falls_back_to_plain_generate(fixture, request):
    model_and_tokenizer = request.getfixturevalue(fixture)
    tokenizer = model_and_tokenizer[1]
    expected = reference_ids(model_and_tokenizer[0], prompt_ids(tokenizer))
    measured = content_engine(model_and_tokenizer)
    first = run(measured, segments=SEGMENTS, mode="chunk_kv_reuse", recompute_strategy="cacheblend",
                recompute_ratio=0.15)
    assert first.repair_risk > 0 and not first.fidelity_guard
    assert (measured.stats()["guard_checks"], measured.stats()["guard_fallbacks"]) == (1, 0)
    guarded = content_engine(model_and_tokenizer, guard_threshold=first.repair_risk / 2)
    outcome = run(guarded, segments=SEGMENTS, mode="chunk_kv_reuse", recompute_strategy="cacheblend",
                  recompute_ratio=0.15)
    assert outcome.fidelity_guard and outcome.repair_risk == pytest.approx(first.repair_risk)
    assert outcome.recomputed_tokens == outcome.cached_tokens == document_tokens(tokenizer)
    assert outcome.output_token_ids == expected  # every content hit recomputed: plain generate's answer
    assert (guarded.stats()["guard_checks"], guarded.stats()["guard_fallbacks"]) == (1, 1)
    result = convert.generation_result(outcome)
    assert result.fidelity_guard and result.repair_risk == pytest.approx(first.repair_risk)
    assert convert.stats_reply(guarded.stats()).guard_fallbacks == 1
