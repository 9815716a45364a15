"""The HTTP gateway as real processes (cache daemon, inference service with a tiny model, gateways) used
through the official `openai` package and raw HTTP: outputs equal gRPC Generate's, usage with cached tokens,
logprobs, n, cache_salt, tokenize, every error status, and disconnects that stop the model."""
from __future__ import annotations

import itertools
import json
import re
import socket
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest

from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from tests.conftest import pick_free_port, wait_for
from tests.e2e.daemon_process import start_daemon
from tests.e2e.gateway_process import GatewayProcess, running_gateways
from tests.e2e.service_process import ServiceProcess, running_service
from tests.e2e.stack_process import save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TOKEN = "service-secret"
CHUNK_SIZE = 32
LONG = 4000  # new tokens that take the tiny model seconds: room for a disconnect or a deadline first
WAIT_S = 30.0


@dataclass
class Stack:
    service: ServiceProcess
    main: GatewayProcess  # the right token
    wrong_token: GatewayProcess
    short_deadline: GatewayProcess  # --timeout 1
    no_service: GatewayProcess  # points at a port nobody listens on
    model: str

    def client(self, gateway: GatewayProcess | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{(gateway or self.main).base_url}/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def grpc_generate(self, **fields) -> pb.GenerationResult:
        with grpc.insecure_channel(self.service.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            events = list(stub.Generate(pb.GenerateRequest(**fields), timeout=60,
                                        metadata=(("authorization", f"Bearer {TOKEN}"),)))
        return events[-1].result

    def queue_depth(self) -> int:
        with grpc.insecure_channel(self.service.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            return stub.Stats(pb.ServiceStatsRequest(), timeout=10,
                              metadata=(("authorization", f"Bearer {TOKEN}"),)).queue_depth


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    folder = tmp_path_factory.mktemp("gateway-e2e")
    model_dir = save_tiny_model(folder / "tiny-model")
    (folder / "token").write_text(TOKEN)
    daemon = start_daemon(folder / "lmdb", pick_free_port())
    try:
        with ExitStack() as stack:
            # --max-running-requests 1 --max-queue 1: one request runs, one waits to join the running batch, the
            # next gets RESOURCE_EXHAUSTED (429).
            service = stack.enter_context(running_service(
                str(model_dir), daemon.address, pick_free_port(), folder / "service.log", "--chunk-size",
                str(CHUNK_SIZE), "--max-queue", "1", "--max-running-requests", "1",
                "--auth-token-file", str(folder / "token")))
            gateways = stack.enter_context(running_gateways(
                (service.address, pick_free_port(), folder / "main.log", "--token-file", str(folder / "token")),
                (service.address, pick_free_port(), folder / "wrong.log", "--token", "wrong"),
                (service.address, pick_free_port(), folder / "short.log", "--token-file", str(folder / "token"),
                 "--timeout", "1"),
                (f"127.0.0.1:{pick_free_port()}", pick_free_port(), folder / "none.log"),
            ))
            yield Stack(service, *gateways, model=str(model_dir))
    finally:
        daemon.terminate()


def unique(text: str) -> str:
    """A prompt no other test shares (the cache persists across tests)."""
    return f"[{uuid.uuid4().hex}] {text}"


def sse(lines) -> list:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def service_logged_cancel(stack: Stack, request_id: str) -> bool:
    return re.search(rf"\[{request_id}\] .*generated \(cancelled\)", stack.service.log()) is not None


# ---- outputs -------------------------------------------------------------------------------------

def test_greedy_chat_equals_grpc_generate_streaming_or_not(stack):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": unique("Name a ferry.")}]
    expected = stack.grpc_generate(messages=[pb.ChatMessage(**m) for m in messages], max_new_tokens=12,
                                   temperature=0, mode=pb.BASELINE)
    client = stack.client()
    reply = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"kvboost": {"mode": "baseline"}})
    assert reply.choices[0].message.content == expected.output_text
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (expected.prompt_tokens,
                                                                          expected.generated_tokens)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # present, and 0 in baseline mode
    streamed = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=12, temperature=0,
                                              stream=True, extra_body={"kvboost": {"mode": "baseline"}})
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected.output_text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_streamed_completion_with_usage_is_openai_shaped(stack):
    prompt = unique("The ferry timetable says")
    body = {"model": stack.model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{stack.main.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        data = sse(response.iter_lines())
    assert data[-1] == "[DONE]"
    *chunks, last = [json.loads(item) for item in data[:-1]]
    assert all(chunk["usage"] is None and len(chunk["choices"]) == 1 for chunk in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    whole = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=6, temperature=0)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == whole.choices[0].text


def test_second_call_of_a_shared_prefix_shows_cached_tokens(stack):
    client = stack.client()
    system = {"role": "system", "content": unique("Ferries leave the north pier every hour. " * 4)}

    def ask(question: str):
        return client.chat.completions.create(model=stack.model, messages=[system, {"role": "user", "content": question}],
                                              max_tokens=2, temperature=0,
                                              extra_body={"kvboost": {"mode": "prefix_cache"}})

    first = ask("When is the first ferry?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The first call's chunks are written back in the background, one after another: wait until a second question
    # hits them to the last shared token (one token a character): the whole system message, not only its whole
    # chunks. A question asked while only the leading chunks have landed sees fewer; the next try sees the rest.
    # Each try asks a new question: a repeated one would find the previous try's own partial last chunk.
    deadline, seen = time.monotonic() + WAIT_S, []
    for attempt in itertools.count():
        second = ask(f"And the last one? (try {attempt})")
        seen.append(second.usage.prompt_tokens_details.cached_tokens)
        if seen[-1] >= len(system["content"]):
            break
        assert time.monotonic() < deadline, f"the system message ({len(system['content'])} tokens) was never " \
                                            f"cached whole; cached tokens per try: {seen}"
        time.sleep(0.05)
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_chat_logprobs_with_alternatives(stack):
    reply = stack.client().chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": unique("Hi")}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy: the best one is chosen
        assert item.bytes == list(item.token.encode())


def test_completion_echo_with_prompt_logprobs(stack):
    prompt = unique("Echo me")
    reply = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                              logprobs=1, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens[: reply.usage.prompt_tokens]) == prompt  # byte tokenizer: tokens spell it


def test_n_choices_share_one_request(stack):
    reply = stack.client().completions.create(model=stack.model, prompt=unique("Pick"), max_tokens=4, n=3,
                                              temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 12
    assert len({choice.text for choice in reply.choices}) > 1  # seeds seed + i: the choices differ


def test_seed_minus_one_with_n_choices_wraps(stack):
    """seed -1 is 2**64 - 1 to the service; its second choice samples with seed 0 (modulo 2**64), not a 500."""
    reply = stack.client().completions.create(model=stack.model, prompt=unique("Pick"), max_tokens=4, n=2,
                                              temperature=1.0, seed=-1, extra_body={"ignore_eos": True})
    assert [choice.index for choice in reply.choices] == [0, 1] and reply.usage.completion_tokens == 8
    with grpc.insecure_channel(stack.service.address) as channel:
        events = list(inference_pb2_grpc.InferenceServiceStub(channel).Generate(pb.GenerateRequest(
            prompt="Pick", max_new_tokens=4, n=2, temperature=1.0, seed=2**64 - 1, ignore_eos=True), timeout=60,
            metadata=(("authorization", f"Bearer {TOKEN}"),)))
    assert sorted(event.result.index for event in events if event.HasField("result")) == [0, 1]


def test_cache_salt_separates_warmed_chunks(stack):
    document = unique("The harbour handbook. " * 6)
    warmed = httpx.post(f"{stack.main.base_url}/v1/kvboost/warm", json={"text": document, "cache_salt": "tenant-a"},
                        timeout=60).json()
    # Whole chunks and the partial last one: a question after the document reuses all of it.
    assert warmed["chunks_stored"] == -(-warmed["token_count"] // CHUNK_SIZE) >= 4

    def cached(**extra):
        return stack.client().completions.create(
            model=stack.model, prompt=document + "?", max_tokens=1,
            extra_body={"kvboost": {"mode": "prefix_cache"}, **extra}).usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == warmed["token_count"]
    # Other salts never see the warmed chunks; at most a first character or two that another test's unique()
    # prompt in that namespace happens to share (reuse to the last shared token), far below one chunk.
    assert cached(cache_salt="tenant-b") < CHUNK_SIZE
    assert cached() < CHUNK_SIZE


def test_tokenize_and_detokenize(stack):
    counted = httpx.post(f"{stack.main.base_url}/tokenize", json={"prompt": "Hello", "return_token_strs": True}).json()
    assert counted["count"] == 5 and counted["token_strs"] == list("Hello") and counted["max_model_len"] == 4096
    chat = httpx.post(f"{stack.main.base_url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 2
    text = httpx.post(f"{stack.main.base_url}/detokenize", json={"tokens": counted["tokens"]}).json()
    assert text == {"prompt": "Hello"}


def test_models_health_and_metrics(stack):
    assert stack.client().models.list().data[0].id == stack.model
    health = httpx.get(f"{stack.main.base_url}/health").json()
    assert health == {"status": "ok", "service": "SERVING", "cache": "SERVING"}
    down = httpx.get(f"{stack.no_service.base_url}/health")
    assert down.status_code == 503 and down.json()["service"] == "UNREACHABLE"
    stack.client().completions.create(model=stack.model, prompt=unique("x"), max_tokens=1)
    metrics = httpx.get(f"{stack.main.base_url}/metrics").text
    for name in ('kvboost_gateway_requests_total{endpoint="/v1/completions",status="200"}',
                 'kvboost_gateway_ttft_seconds_count{endpoint="/v1/completions"}', "kvboost_gateway_cached_tokens_total",
                 "kvboost_gateway_errors_total", "kvboost_gateway_aborted_requests_total"):
        assert name in metrics or name.split("{")[0] in metrics


# ---- errors ----------------------------------------------------------------------------------------

def test_sdk_error_classes_for_each_status(stack):
    messages = [{"role": "user", "content": "Hi"}]
    cases = [
        (stack.client(), dict(model=stack.model, tools=[{"type": "function", "function": {"name": "f"}}]),
         openai.BadRequestError, 400),
        (stack.client(), dict(model="gpt-4o"), openai.NotFoundError, 404),
        (stack.client(stack.wrong_token), dict(model=stack.model), openai.AuthenticationError, 401),
        (stack.client(stack.no_service), dict(model=stack.model), openai.InternalServerError, 503),
        (stack.client(stack.short_deadline), dict(model=stack.model, max_tokens=LONG, extra_body={"ignore_eos": True}),
         openai.InternalServerError, 504),
    ]
    errors = []
    for client, fields, error_class, status in cases:
        with pytest.raises(error_class) as raised:
            client.chat.completions.create(messages=messages, **fields)
        assert raised.value.status_code == status, fields
        assert set(raised.value.body) >= {"message", "type", "param", "code"}
        errors.append(raised.value.body)
    assert errors[0]["param"] == "tools" and "tools" in errors[0]["message"]
    assert errors[1]["code"] == "model_not_found"
    assert (errors[2]["type"], errors[3]["code"], errors[4]["code"]) == (
        "authentication_error", "service_unavailable", "timeout")


@pytest.mark.parametrize("body, status, param_or_code", [
    ('{"model": 1', 400, None),
    ('{"messages": []}', 400, "messages"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}', 400, "max_tokens"),
    ('{"messages": [{"role": "user", "content": "' + "x" * 4200 + '"}]}', 400, "context_length_exceeded"),
    ('{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10}}', 400, "logit_bias"),
])
def test_raw_http_bad_requests_are_400_with_openai_errors(stack, body, status, param_or_code):
    response = httpx.post(f"{stack.main.base_url}/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param_or_code:
        assert param_or_code in (error["param"], error["code"]), error


def test_unknown_route_and_method(stack):
    assert httpx.get(f"{stack.main.base_url}/v1/engines").json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{stack.main.base_url}/v1/completions").status_code == 405


def test_error_after_the_stream_began_is_a_chunk_then_done(stack):
    body = {"model": stack.model, "prompt": unique("Go on"), "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.short_deadline.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        data = sse(response.iter_lines())
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "timeout")
    assert any(json.loads(item).get("choices") for item in data[:-2])  # tokens came before the error


# ---- queueing and disconnects ----------------------------------------------------------------------

def test_full_queue_is_429_with_retry_after_and_closed_streams_stop_the_model(stack):
    running_id, waiting = f"running-{uuid.uuid4().hex[:8]}", {}
    body = {"model": stack.model, "prompt": unique("Keep going"), "max_tokens": LONG, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{stack.main.base_url}/v1/completions", json=body,
                         headers={"X-Request-Id": running_id}) as running:
            lines = running.iter_lines()  # kept: a dropped httpx line iterator closes the connection
            next(lines)  # the first token is out: the model is busy with this request

            def wait_in_queue():
                waiting["reply"] = httpx.post(f"{stack.main.base_url}/v1/completions", timeout=120,
                                              json={"model": stack.model, "prompt": "queued", "max_tokens": 2})

            queued = threading.Thread(target=wait_in_queue)
            queued.start()
            wait_for(lambda: stack.queue_depth() == 1, "the second request to wait in the service's queue", timeout_s=WAIT_S)
            refused = http.post(f"{stack.main.base_url}/v1/completions",
                                json={"model": stack.model, "prompt": "third", "max_tokens": 2})
            assert refused.status_code == 429 and float(refused.headers["retry-after"]) >= 0
            assert refused.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                stack.client().completions.create(model=stack.model, prompt="fourth", max_tokens=2)
        # Leaving the stream closed the connection: the service stops decoding it, the queued one runs.
    wait_for(lambda: service_logged_cancel(stack, running_id), "the service to cancel the abandoned stream", timeout_s=WAIT_S)
    queued.join(timeout=WAIT_S)
    assert waiting["reply"].status_code == 200


def test_a_non_streaming_client_that_leaves_cancels_the_generation(stack):
    request_id = f"leaver-{uuid.uuid4().hex[:8]}"
    payload = json.dumps({"model": stack.model, "prompt": unique("Long answer please"), "max_tokens": LONG,
                          "ignore_eos": True}).encode()
    host, port = stack.main.base_url.removeprefix("http://").split(":")

    def first_tokens_seen() -> float:
        metrics = httpx.get(f"{stack.main.base_url}/metrics").text
        found = re.search(r'kvboost_gateway_ttft_seconds_count\{endpoint="/v1/completions"\} (\S+)', metrics)
        return float(found.group(1)) if found else 0.0

    before = first_tokens_seen()
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                           + f"X-Request-Id: {request_id}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_for(lambda: first_tokens_seen() > before, "the model to start on the request", timeout_s=WAIT_S)
    # The socket is closed: the gateway cancels the gRPC call and the service stops at its next step.
    wait_for(lambda: service_logged_cancel(stack, request_id), "the service to cancel the abandoned request", timeout_s=WAIT_S)
    aborted = httpx.get(f"{stack.main.base_url}/metrics").text
    assert re.search(r'kvboost_gateway_aborted_requests_total\{endpoint="/v1/completions"\} [1-9]', aborted)
