"""Property-based bad input against the in-process inference server (tiny Llama): every call ends with OK or a
documented status, nothing crashes, and a plain request gives the same output after the fuzzing as before."""
from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_service.store.memory import InMemoryStore
from inference_service.serving.config import ServiceConfig
from inference_service.engine.engine import Engine, EngineConfig
from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from tests.service_support import serving_in_thread

MAX_EXAMPLES = 40  # per test; the module runs in well under 60 s on CPU
CHUNK_SIZE = 8
MAX_NEW_TOKENS = 16      # the server's --max-new-tokens: valid requests stay short
MAX_PROMPT_TOKENS = 256  # the server's --max-prompt-tokens: longer prompts are refused, not run
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Defined enum values and undefined ones (proto3 enums are open: a client may send any int32): an undefined
# Mode or RecomputeStrategy must get INVALID_ARGUMENT, never INTERNAL.
MODES = [0, 1, 2, 3, 4, 7, 2**31 - 1, -1]
STRATEGIES = [0, 1, 2, 3, 4, 9, 2**31 - 1, -1]
REFERENCE = dict(prompt="The harbour ferry leaves at six. " * 2, max_new_tokens=8, mode=pb.PREFIX_CACHE)

seen_codes: dict[str, set[grpc.StatusCode]] = {}


@pytest.fixture(scope="module")
def stub(tiny_llama):
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK_SIZE, max_new_tokens_limit=MAX_NEW_TOKENS,
                                                   max_prompt_tokens=MAX_PROMPT_TOKENS),
                    InMemoryStore(), model_id="tiny-llama")
    config = ServiceConfig(listen="127.0.0.1:0", cache_addr="in-process", engine=engine.config)
    try:
        with serving_in_thread(config, engine) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            service_stub = inference_pb2_grpc.InferenceServiceStub(channel)
            service_stub.channel = channel  # for raw, undecodable requests
            before = final_result(service_stub, pb.GenerateRequest(**REFERENCE))
            yield service_stub
            after = final_result(service_stub, pb.GenerateRequest(**REFERENCE))
            assert list(after.output_token_ids) == list(before.output_token_ids), "fuzzing changed a plain request"
            stats = service_stub.Stats(pb.ServiceStatsRequest(), timeout=10)
            assert stats.requests > 0
            print("\nstatus codes seen per RPC:", {rpc: sorted(code.name for code in codes)
                                                  for rpc, codes in sorted(seen_codes.items())})
    finally:
        engine.close()


def final_result(stub, request: pb.GenerateRequest) -> pb.GenerationResult:
    events = list(stub.Generate(request, timeout=60))
    assert events and events[-1].HasField("result"), "the stream must end with a result"
    return events[-1].result


def call(rpc: str, function) -> grpc.StatusCode:
    try:
        function()
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
        assert code in DOCUMENTED, f"{rpc}: undocumented status {code}: {error.details()}"
        assert error.details(), f"{rpc}: {code} without a message"
    seen_codes.setdefault(rpc, set()).add(code)
    return code


# Text: empty, odd Unicode (controls, combining marks, emoji, NUL), or longer than the prompt limit.
texts = st.one_of(st.just(""), st.text(max_size=60), st.text(alphabet="abc .,", min_size=1, max_size=60),
                  st.text(alphabet=st.characters(codec="utf-8"), max_size=30),
                  st.sampled_from(["\x00", "\ufffd", "\u202e", "🙂" * 40, "a\u0301" * 20, "x" * (MAX_PROMPT_TOKENS + 1),
                                   "y" * 5000]))
floats = st.one_of(st.floats(min_value=0.05, max_value=1.0), st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 3.4e38]))
messages = st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant", "robot", ""]),
                              content=texts), max_size=3)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    fields: dict = {}
    # Mostly exactly one input (as valid requests have), sometimes none or several.
    which = draw(st.one_of(st.sampled_from([{"prompt"}, {"prompt"}, {"messages"}, {"segments"}]),
                           st.sets(st.sampled_from(["prompt", "messages", "segments"]), max_size=3)))
    if "prompt" in which:
        fields["prompt"] = draw(texts)
    if "messages" in which:
        fields["messages"] = draw(messages)
    if "segments" in which:
        fields["segments"] = draw(st.lists(texts, max_size=3))
    fields["max_new_tokens"] = draw(st.one_of(st.integers(0, 4), st.sampled_from([MAX_NEW_TOKENS + 1, 2**32 - 1])))
    fields["mode"] = draw(st.sampled_from(MODES))
    fields["recompute_strategy"] = draw(st.sampled_from(STRATEGIES))
    if draw(st.booleans()):
        fields["temperature"] = draw(floats)
    if draw(st.booleans()):
        fields["top_p"] = draw(floats)
    if draw(st.booleans()):
        fields["top_k"] = draw(st.sampled_from([0, 1, 5, 2**32 - 1]))
    if draw(st.booleans()):
        fields["seed"] = draw(st.sampled_from([0, 1, 2**64 - 1]))
    if draw(st.booleans()):
        fields["stop"] = draw(st.lists(texts, max_size=3))
    if draw(st.booleans()):
        fields["recompute_ratio"] = draw(floats)
    if draw(st.booleans()):
        fields["selective_tokens"] = draw(st.sampled_from([0, 1, 2**32 - 1]))
    fields["request_id"] = draw(st.text(max_size=10))
    return pb.GenerateRequest(**fields)


@FUZZ_SETTINGS
@given(request=generate_requests())
def test_generate(stub, request) -> None:
    def run():
        result = final_result(stub, request)
        assert result.generated_tokens <= MAX_NEW_TOKENS
    call("Generate", run)


@FUZZ_SETTINGS
@given(requests=st.lists(generate_requests(), max_size=3), many=st.booleans())
def test_generate_batch(stub, requests, many) -> None:
    method = stub.GenerateMany if many else stub.GenerateBatch
    call("GenerateMany" if many else "GenerateBatch",
         lambda: method(pb.GenerateBatchRequest(requests=requests), timeout=60))


@FUZZ_SETTINGS
@given(text=texts, messages=messages, content_addressed=st.booleans(), pin=st.booleans())
def test_warm(stub, text, messages, content_addressed, pin) -> None:
    call("Warm", lambda: stub.Warm(pb.WarmRequest(text=text, messages=messages, content_addressed=content_addressed,
                                                  pin=pin), timeout=60))


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(texts, max_size=2), max_new_tokens=st.sampled_from([0, 1, 3, MAX_NEW_TOKENS + 1, 2**32 - 1]),
       mode=st.sampled_from(MODES))
def test_verify(stub, prompts, max_new_tokens, mode) -> None:
    call("VerifyCorrectness", lambda: stub.VerifyCorrectness(
        pb.VerifyRequest(prompts=prompts, max_new_tokens=max_new_tokens, mode=mode), timeout=60))


@pytest.mark.parametrize("fields", [
    dict(prompt="hi", messages=[pb.ChatMessage(role="user", content="hi")]),
    dict(prompt=""),
    dict(prompt="hi", temperature=math.nan),
    dict(prompt="hi", temperature=-1.0),
    dict(prompt="hi", temperature=math.inf),
    dict(prompt="hi", top_p=0.0),
    dict(prompt="hi", top_p=1.5),
    dict(prompt="hi", max_new_tokens=MAX_NEW_TOKENS + 1),
    dict(prompt="z" * (MAX_PROMPT_TOKENS + 1)),
    dict(prompt="hi", mode=7),
    dict(prompt="hi", mode=-1),
    dict(prompt="hi", recompute_strategy=9),
])
def test_known_bad_requests_are_invalid_argument(stub, fields) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        final_result(stub, pb.GenerateRequest(**fields))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()


@pytest.mark.parametrize("wire", [
    b"\x0a\x02hi" + b"\x52\x02\xff\xfe",  # stop string with invalid UTF-8
    b"\x0a\x03\xc3\x28!",                 # prompt with invalid UTF-8
    b"\x0a\x05hi",                        # truncated message
])
def test_undecodable_requests_get_a_status_and_the_server_keeps_serving(stub, wire) -> None:
    """Bytes no client library would send: they do not parse, and the UndecodableRequestInterceptor answers
    INVALID_ARGUMENT before the servicer runs (tests/kvboost_common/test_undecodable.py covers every RPC and string field);
    the process and later requests are unaffected."""
    raw = stub.channel.unary_stream("/kvboost.v1.InferenceService/Generate")
    with pytest.raises(grpc.RpcError) as raised:
        list(raw(wire, timeout=10))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert raised.value.details().startswith("/kvboost.v1.InferenceService/Generate: request not parsed")
    assert final_result(stub, pb.GenerateRequest(prompt="still serving", max_new_tokens=1)).generated_tokens == 1
