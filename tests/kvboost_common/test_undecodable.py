"""Requests whose bytes do not parse: both services answer INVALID_ARGUMENT naming the RPC, keep serving, keep
their data. Raw bytes go through `channel.unary_unary(method, request_serializer=lambda b: b)`, as no client
library would send them. Before the UndecodableRequestInterceptor, grpc.aio answered these with
UNKNOWN "Unexpected <class 'google.protobuf.message.DecodeError'>: ... String field had bad UTF-8"."""
from __future__ import annotations

from typing import Iterator

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from inference_service.store.memory import InMemoryStore
from inference_service.serving.config import ServiceConfig
from inference_service.engine.engine import Engine, EngineConfig
from kvboost.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.daemon_support import cache_stub, fetch_chunks, make_chunk, running_daemon, store_chunks, store_frames
from tests.service_support import serving_in_thread

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80", b"\xf8\x88\x80\x80\x80"]
KEPT = [make_chunk(f"kept {index}", 3000, pinned=True) for index in range(3)]
REFERENCE = inference_pb2.GenerateRequest(prompt="The harbour ferry leaves at six. " * 2, max_new_tokens=4,
                                          mode=inference_pb2.PREFIX_CACHE)


def raw_call(channel: grpc.Channel, method_descriptor, wire: bytes | list[bytes]) -> grpc.StatusCode:
    """Sends wire bytes (a list of them for a streamed request); drains a streamed reply."""
    method = f"/{method_descriptor.containing_service.full_name}/{method_descriptor.name}"
    kind = ("stream" if method_descriptor.client_streaming else "unary") + "_" + \
           ("stream" if method_descriptor.server_streaming else "unary")
    call = getattr(channel, kind)(method, request_serializer=lambda data: data, response_deserializer=lambda data: data)
    try:
        reply = call(iter(wire) if method_descriptor.client_streaming else wire, timeout=30)
        if method_descriptor.server_streaming:
            list(reply)
    except grpc.RpcError as error:
        assert error.details(), f"{method}: {error.code()} without a message"
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not parsed" in error.details():
            assert error.details().startswith(method + ": "), error.details()
        return error.code()
    return grpc.StatusCode.OK


def parses(message_class: type[Message], wire: bytes) -> bool:
    try:
        message_class.FromString(wire)
    except DecodeError:
        return False
    return True


# --- cache daemon: no request message has a string field, so undecodable means corrupt wire format -------------

DAEMON_METHODS = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].methods
DAEMON_METHODS_BY_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].methods_by_name
CORRUPT = [b"\xff", b"\x0a\x05hi", b"\x0a", b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x0c", b"\x0f"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("undecodable") / "lmdb", max_bytes=64 << 20) as running:
        with cache_stub(running.address) as stub:
            assert store_chunks(stub, KEPT, timeout=30).stored == len(KEPT)
            with grpc.insecure_channel(running.address) as channel:
                yield channel
            # After everything: the daemon serves and the kept chunks are bit-exact.
            fetched = fetch_chunks(stub, [chunk.key for chunk in KEPT], timeout=30)
            assert [chunk.blob for chunk in fetched] == [chunk.blob for chunk in KEPT], "kept chunks changed"
            assert stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10).entries == len(KEPT)


@pytest.mark.parametrize("method", DAEMON_METHODS, ids=lambda method: method.name)
@pytest.mark.parametrize("wire", CORRUPT)
def test_daemon_corrupt_request_is_invalid_argument(daemon, method, wire) -> None:
    assert not parses(method.input_type._concrete_class, wire)
    frames = [wire] if method.client_streaming else wire
    assert raw_call(daemon, method, frames) == grpc.StatusCode.INVALID_ARGUMENT


def test_store_with_an_undecodable_frame_mid_stream_commits_nothing(daemon) -> None:
    # A whole chunk, then a frame that does not parse: the call fails and the chunk is not stored.
    chunk = make_chunk("sent before the corrupt frame", 2000)
    frames = [frame.SerializeToString() for frame in store_frames([chunk])] + [b"\x12\x05hi"]
    assert raw_call(daemon, DAEMON_METHODS_BY_NAME["Store"], frames) == grpc.StatusCode.INVALID_ARGUMENT
    [fetched] = fetch_chunks(cache_pb2_grpc.CacheServiceStub(daemon), [chunk.key], timeout=10)
    assert not fetched.found


@SETTINGS
@given(method_index=st.integers(0, len(DAEMON_METHODS) - 1), wire=st.binary(max_size=200))
def test_daemon_random_undecodable_bytes_are_invalid_argument(daemon, method_index, wire) -> None:
    # Parsable requests are the fuzz tests' business (test_fuzz_daemon.py); here only bytes that do not parse.
    method = DAEMON_METHODS[method_index]
    assume(not parses(method.input_type._concrete_class, wire))
    assert raw_call(daemon, method, [wire] if method.client_streaming else wire) == grpc.StatusCode.INVALID_ARGUMENT


def test_unauthenticated_undecodable_call_is_refused_first(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with running_daemon(tmp_path / "lmdb", auth_token_file=token_file) as running:
        with grpc.insecure_channel(running.address) as channel:
            assert raw_call(channel, DAEMON_METHODS[0], b"\xff") == grpc.StatusCode.UNAUTHENTICATED


# --- inference service: invalid UTF-8 in every string field of every request message ----------------------------

SERVICE_METHODS = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].methods


def string_paths(descriptor, prefix: tuple[str, ...] = (), depth: int = 0) -> Iterator[tuple[str, ...]]:
    """Paths to every string field reachable from a message type (nested messages two levels deep)."""
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            yield prefix + (field.name,)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < 2:
            yield from string_paths(field.message_type, prefix + (field.name,), depth + 1)


def with_string(message: Message, path: tuple[str, ...], value: str) -> Message:
    """Sets the string at path (adding one element to each repeated field on the way) to value."""
    target = message
    for name in path[:-1]:
        field = target.DESCRIPTOR.fields_by_name[name]
        target = getattr(target, name).add() if field.is_repeated else getattr(target, name)
    field = target.DESCRIPTOR.fields_by_name[path[-1]]
    if field.is_repeated:
        getattr(target, path[-1]).append(value)
    else:
        setattr(target, path[-1], value)
    return message


def invalid_utf8_request(method, path: tuple[str, ...], bad: bytes) -> bytes:
    """The method's request with bad bytes in the string at path: a placeholder of the same length is
    serialized and swapped, so every length prefix stays right."""
    placeholder = "Q" * len(bad)
    message = with_string(method.input_type._concrete_class(), path, placeholder)
    wire = message.SerializeToString()
    assert wire.count(placeholder.encode()) == 1
    return wire.replace(placeholder.encode(), bad)


STRING_FIELDS = [(method, path) for method in SERVICE_METHODS for path in string_paths(method.input_type)]


def test_every_request_string_field_is_covered() -> None:
    names = {f"{method.name}:{'.'.join(path)}" for method, path in STRING_FIELDS}
    assert {"Generate:prompt", "Generate:stop", "Generate:segments", "Generate:messages.content",
            "Generate:request_id", "GenerateBatch:requests.stop", "GenerateMany:requests.prompt", "Warm:text",
            "Warm:messages.role", "VerifyCorrectness:prompts"} <= names


@pytest.fixture(scope="module")
def service(tiny_llama):
    model, tokenizer = tiny_llama
    cache = InMemoryStore()
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, max_new_tokens_limit=8, max_prompt_tokens=256),
                    cache, model_id="tiny-llama")
    config = ServiceConfig(listen="127.0.0.1:0", cache_addr="in-process", engine=engine.config)
    with serving_in_thread(config, engine) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        before = list(stub.Generate(REFERENCE, timeout=60))[-1].result
        engine.flush_writes(timeout=30)
        num_entries = len(cache)
        yield channel
        # After everything: the service answers the same request the same way and the cache is unchanged.
        after = list(stub.Generate(REFERENCE, timeout=60))[-1].result
        engine.flush_writes(timeout=30)
        assert list(after.output_token_ids) == list(before.output_token_ids)
        assert after.cached_tokens > 0 and len(cache) == num_entries
    engine.close()


@pytest.mark.parametrize("method, path", STRING_FIELDS,
                         ids=[f"{method.name}:{'.'.join(path)}" for method, path in STRING_FIELDS])
def test_invalid_utf8_in_each_string_field_is_invalid_argument(service, method, path) -> None:
    wire = invalid_utf8_request(method, path, b"\xff\xfe")
    call = getattr(service, "unary_stream" if method.server_streaming else "unary_unary")(
        f"/{method.containing_service.full_name}/{method.name}", request_serializer=lambda data: data)
    with pytest.raises(grpc.RpcError) as raised:
        reply = call(wire, timeout=30)
        if method.server_streaming:
            list(reply)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"/kvboost.v1.InferenceService/{method.name}: ")
    assert "not valid UTF-8" in raised.value.details()


@SETTINGS
@given(field_index=st.integers(0, len(STRING_FIELDS) - 1), bad=st.sampled_from(INVALID_UTF8))
def test_invalid_utf8_anywhere_is_invalid_argument(service, field_index, bad) -> None:
    method, path = STRING_FIELDS[field_index]
    assert raw_call(service, method, invalid_utf8_request(method, path, bad)) == grpc.StatusCode.INVALID_ARGUMENT


@SETTINGS
@given(method_index=st.integers(0, len(SERVICE_METHODS) - 1), wire=st.binary(max_size=200))
def test_service_random_undecodable_bytes_are_invalid_argument(service, method_index, wire) -> None:
    # Parsable requests are the fuzz tests' business (test_fuzz_service.py); here only bytes that do not parse.
    method = SERVICE_METHODS[method_index]
    assume(not parses(method.input_type._concrete_class, wire))
    assert raw_call(service, method, wire) == grpc.StatusCode.INVALID_ARGUMENT
