"""KVBoostClient and CacheClient against in-process fake servicers: requests built, results mapped, errors raised."""
from __future__ import annotations

import dataclasses
import json

import grpc
import pytest

from client import (
    AuthenticationError,
    CacheClient,
    DeadlineExceededError,
    GenerationResult,
    InvalidArgumentError,
    KVBoostClient,
    KVBoostError,
    NotFoundError,
    OverloadedError,
    UnavailableError,
)
from client import results
from client.request_builders import build_generate_request, parse_key
from kvboost.v1 import cache_pb2, inference_pb2
from tests.client_fakes import KEY_A, KEY_B, NAMESPACE, FakeCache, FakeInference, running_server
from tests.conftest import pick_free_port

GENERATION_RESULT_FIELDS = [
    "output_text", "generated_tokens", "ttft_ms", "total_ms", "tokens_per_sec", "kv_reuse_ratio",
    "prompt_tokens", "cached_tokens", "recomputed_tokens", "mode", "finish_reason", "output_token_ids",
    "degraded", "request_id", "index", "repair_risk", "fidelity_guard", "approximate", "approximate_tokens",
]


@pytest.fixture()
def inference():
    return FakeInference()


@pytest.fixture()
def client(inference):
    with running_server(inference=inference) as address, KVBoostClient(address, timeout=5) as client:
        yield client


# --- result types mirror the contract -------------------------------------------------------------

@pytest.mark.parametrize("result_type, message", [
    (results.GenerationResult, inference_pb2.GenerationResult),
    (results.WarmResult, inference_pb2.WarmResult),
    (results.VerifyReport, inference_pb2.VerifyReport),
    (results.PromptVerification, inference_pb2.PromptVerification),
    (results.ServiceStats, inference_pb2.ServiceStatsReply),
    (results.ModelInfo, inference_pb2.ModelInfoReply),
    (results.CacheStats, cache_pb2.CacheStatsReply),
    (results.NamespaceStats, cache_pb2.NamespaceStats),
    (results.L2Stats, cache_pb2.L2Stats),
    (results.DeleteResult, cache_pb2.DeleteReply),
    (results.PinResult, cache_pb2.PinReply),
])
def test_result_types_have_exactly_the_proto_fields_in_order(result_type, message) -> None:
    assert [field.name for field in dataclasses.fields(result_type)] == [
        field.name for field in message.DESCRIPTOR.fields]


def test_message_to_dict_names_enums_hexes_bytes_keeps_64_bit_ints() -> None:
    stats = results.message_to_dict(cache_pb2.CacheStatsReply(
        bytes=2**40, namespaces=[cache_pb2.NamespaceStats(namespace=b"\x01\xff")]))
    assert stats["bytes"] == 2**40 and stats["namespaces"][0]["namespace"] == "01ff"
    result = results.message_to_dict(inference_pb2.GenerationResult(mode=inference_pb2.PREFIX_CACHE))
    assert result["mode"] == "PREFIX_CACHE"
    # Optional fields report None when unset, their value when set.
    request = results.message_to_dict(inference_pb2.GenerateRequest(top_k=0))
    assert request["top_k"] == 0 and request["top_p"] is None


# --- request building ---------------------------------------------------------------------------

def test_generate_request_sets_optional_fields_only_when_given() -> None:
    request = build_generate_request("hi", mode="prefix-cache", recompute_strategy="CacheBlend", top_k=0)
    assert request.mode == inference_pb2.PREFIX_CACHE
    assert request.recompute_strategy == inference_pb2.CACHEBLEND
    assert request.HasField("top_k") and request.top_k == 0
    assert not request.HasField("top_p") and not request.HasField("seed")


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give exactly one of prompt, messages, segments (got none)"),
    ({"prompt": "a", "segments": ["b"]}, "give exactly one of prompt, messages, segments (got ['prompt', 'segments'])"),
    ({"segments": "one string"}, "segments must be a list of strings, not one string"),
    ({"prompt": "a", "temperature": -1.0}, "temperature must be finite and >= 0, got -1.0"),
    ({"prompt": "a", "mode": "fast"}, "unknown mode 'fast'; choose one of: baseline, prefix_cache, chunk_kv_reuse"),
])
def test_generate_request_refuses_bad_input(kwargs, message) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        build_generate_request(**kwargs)
    assert str(caught.value) == message
    assert caught.value.code is None  # refused in the client, before any call


def test_parse_key_takes_bytes_or_hex_and_checks_the_length() -> None:
    assert parse_key(KEY_A.hex()) == KEY_A == parse_key(KEY_A)
    with pytest.raises(InvalidArgumentError, match="a key is 32 bytes"):
        parse_key("abcd")
    with pytest.raises(InvalidArgumentError, match="not a hex key"):
        parse_key("zz" * 32)


# --- generate -----------------------------------------------------------------------------------

def test_generate_streams_text_then_holds_the_result(client, inference) -> None:
    stream = client.generate("Say hello", max_new_tokens=2, mode="baseline", stop=["\n"], seed=3)
    assert list(stream) == ["Hello", " world"]
    assert stream.text == "Hello world"
    result = stream.result
    assert isinstance(result, GenerationResult)
    assert list(result.to_dict()) == GENERATION_RESULT_FIELDS
    assert result.to_dict() == {
        "output_text": "Hello world", "generated_tokens": 2, "ttft_ms": 12.5, "total_ms": 20.0,
        "tokens_per_sec": 100.0, "kv_reuse_ratio": 0.75, "prompt_tokens": 8, "cached_tokens": 6,
        "recomputed_tokens": 1, "mode": "BASELINE", "finish_reason": "length", "output_token_ids": (11, 12),
        "degraded": False, "request_id": "req-1", "index": 0, "repair_risk": 0.0, "fidelity_guard": False,
        "approximate": False, "approximate_tokens": 0,
    }
    json.dumps(result.to_dict())  # serialisable as it is
    sent = inference.requests[0]
    assert (sent.prompt, sent.max_new_tokens, sent.mode, list(sent.stop), sent.seed) == (
        "Say hello", 2, inference_pb2.BASELINE, ["\n"], 3)


def test_result_without_iterating_consumes_the_stream(client) -> None:
    assert client.generate("hi").result.output_text == "Hello world"


def test_generate_sends_chat_messages(client, inference) -> None:
    _ = client.generate(messages=[{"role": "system", "content": "Be brief."}, ("user", "Hi")]).result
    assert [(m.role, m.content) for m in inference.requests[0].messages] == [("system", "Be brief."), ("user", "Hi")]
    assert inference.requests[0].prompt == ""


def test_stream_without_result_is_an_error(client) -> None:
    stream = client.generate("noresult")
    with pytest.raises(KVBoostError, match="ended without a result"):
        _ = stream.result


def test_server_errors_become_typed_exceptions_with_the_code(client) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        list(client.generate("invalid"))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details == "prompt is empty after templating"
    assert str(caught.value).endswith("Generate on " + client.address +
                                      " failed: INVALID_ARGUMENT: prompt is empty after templating")
    with pytest.raises(OverloadedError) as caught:
        _ = client.generate("busy").result
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_timeout_raises_deadline_exceeded(client) -> None:
    with pytest.raises(DeadlineExceededError) as caught:
        _ = client.generate("slow", timeout=0.3).result
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(caught.value) == f"Generate on {client.address} timed out after 0.3 s"
    assert isinstance(caught.value, TimeoutError)


def test_unreachable_server_raises_unavailable() -> None:
    address = f"127.0.0.1:{pick_free_port()}"
    with KVBoostClient(address, timeout=2) as client:
        with pytest.raises(UnavailableError) as caught:
            client.stats()
        assert str(caught.value).startswith(f"cannot reach {address} (Stats): ")
        with pytest.raises(UnavailableError, match=f"cannot reach {address} within 0.2 s"):
            client.wait_ready(timeout=0.2)


def test_token_goes_out_as_bearer_metadata(inference) -> None:
    with running_server(inference=inference, token="s3cret") as address:
        with KVBoostClient(address, token="s3cret", timeout=5) as client:
            assert client.stats().requests == 7
        assert inference.metadata[0]["authorization"] == "Bearer s3cret"
        with KVBoostClient(address, token="wrong", timeout=5) as client:
            with pytest.raises(AuthenticationError) as caught:
                client.stats()
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


# --- batch, warm, verify, stats, info -------------------------------------------------------------

def test_generate_batch_and_many_keep_input_order(client, inference) -> None:
    requests = ["first", {"prompt": "second", "request_id": "r2"},
                inference_pb2.GenerateRequest(prompt="third")]
    for method in (client.generate_batch, client.generate_many):
        outputs = method(requests)
        assert [result.output_text for result in outputs] == ["echo:first", "echo:second", "echo:third"]
        assert outputs[1].request_id == "r2"
    assert [len(sent.requests) for sent in inference.requests] == [3, 3]


def test_warm_returns_the_warm_result(client, inference) -> None:
    result = client.warm("one two three four five six", content_addressed=True, pin=True)
    assert result.to_dict() == {
        "chunks_stored": 1, "token_count": 6, "chunk_size": 4, "chunk_boundary_aligned": False,
        "partial_tail_tokens": 2, "alignment_warning": "2 tail tokens not stored",
    }
    assert inference.requests[0].content_addressed and inference.requests[0].pin
    client.warm(messages=[{"role": "system", "content": "You are terse."}])
    assert inference.requests[1].messages[0].role == "system"
    with pytest.raises(InvalidArgumentError, match="give exactly one of text, messages"):
        client.warm()


def test_unpin_sends_the_warm_ups_text_and_returns_the_count(client, inference) -> None:
    result = client.unpin("one two three four five six", content_addressed=True)
    assert result.to_dict() == {"chunks_unpinned": 2, "token_count": 6}
    assert inference.requests[0].text == "one two three four five six" and not inference.requests[0].pin
    with pytest.raises(InvalidArgumentError, match="give exactly one of text, messages"):
        client.unpin()


def test_verify_stats_and_model_info(client, inference) -> None:
    report = client.verify_correctness(["same", "differs"], max_new_tokens=8, mode="chunk_kv_reuse")
    assert (report.identical, report.total) == (1, 2)
    assert [check.token_identical for check in report.prompts] == [True, False]
    assert inference.requests[0].mode == inference_pb2.CHUNK_KV_REUSE
    stats = client.stats()
    assert (stats.requests, stats.prompt_tokens, stats.degraded, stats.mean_ttft_ms) == (7, 2**40, True, 33.25)
    info = client.model_info()
    assert (info.model, info.chunk_size, info.default_recompute_strategy) == ("tiny", 4, "SELECTIVE")


# --- cache daemon client -----------------------------------------------------------------------------

@pytest.fixture()
def cache_fake():
    return FakeCache()


@pytest.fixture()
def cache(cache_fake):
    with running_server(cache=cache_fake) as address, CacheClient(address, timeout=5) as cache:
        yield cache


def test_cache_stats_reports_hex_namespaces(cache, cache_fake) -> None:
    stats = cache.stats(NAMESPACE.hex())
    assert cache_fake.requests[0].namespace == NAMESPACE
    assert stats.to_dict()["namespaces"] == ({"namespace": "ab" * 32, "entries": 2, "bytes": 2048, "pinned": 1},)
    assert (stats.entries, stats.max_bytes) == (2, 2**33)


def test_cache_delete_by_keys_or_namespace(cache, cache_fake) -> None:
    assert cache.delete([KEY_A.hex(), KEY_B]).to_dict() == {"deleted": 2, "bytes_freed": 2048}
    assert list(cache_fake.requests[0].keys) == [KEY_A, KEY_B]
    assert cache.delete(namespace=NAMESPACE).deleted == 2
    with pytest.raises(NotFoundError, match="namespace has no entries"):
        cache.delete(namespace="cd" * 32)
    with pytest.raises(InvalidArgumentError, match="give keys or a namespace"):
        cache.delete()


def test_cache_pin_and_unpin_report_missing_keys(cache) -> None:
    unknown = b"\x07" * 32
    assert cache.pin([KEY_A, unknown]).to_dict() == {"updated": 1, "missing": (unknown.hex(),)}
    assert cache.unpin([KEY_B]).updated == 1
    with pytest.raises(NotFoundError) as caught:
        cache.pin([unknown])
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_unavailable_from_a_live_server_is_not_called_unreachable() -> None:
    class Loading(FakeInference):
        def Stats(self, request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    with running_server(inference=Loading()) as address, KVBoostClient(address, timeout=5) as client:
        with pytest.raises(UnavailableError) as caught:
            client.stats()
    assert str(caught.value) == f"Stats on {address} failed: UNAVAILABLE: the model is still loading"


def test_cache_stats_carry_the_l2_tier_only_when_the_daemon_has_one() -> None:
    without = results.CacheStats.from_proto(cache_pb2.CacheStatsReply(entries=3))
    assert without.l2 is None
    reply = cache_pb2.CacheStatsReply(entries=3, l2=cache_pb2.L2Stats(url="redis://127.0.0.1:6379", degraded=True,
                                                                      hits=5, dropped_writes=2))
    stats = results.CacheStats.from_proto(reply)
    assert stats.l2 == results.L2Stats(url="redis://127.0.0.1:6379", degraded=True, hits=5, misses=0, writes=0,
                                       dropped_writes=2, corrupted=0, errors=0, queued_writes=0)
    assert stats.to_dict()["l2"]["dropped_writes"] == 2
