"""The FastAPI app in process with a fake gRPC upstream: error shapes and statuses, the error chunk after a
stream began, API keys, model names. (tests/e2e/test_gateway.py runs the real processes.)"""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from http_gateway.app import build_app
from http_gateway.config import GatewayConfig
from kvboost.v1 import inference_pb2 as pb
from tests.http_gateway.factories import result, token

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}


def rpc_error(code: grpc.StatusCode, details: str = "details") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeCall:
    """A Generate call that yields `script` items in order (an exception item is raised)."""

    def __init__(self, script: list) -> None:
        self.script = list(script)
        self.cancelled = False

    async def read(self):
        if not self.script:
            return grpc.aio.EOF
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeUpstream:
    def __init__(self, script: list) -> None:
        self.script = script
        self.calls: list[FakeCall] = []
        self.requests: list[pb.GenerateRequest] = []

    def generate(self, request: pb.GenerateRequest) -> FakeCall:
        self.requests.append(request)
        self.calls.append(FakeCall(self.script))
        return self.calls[-1]

    async def model_info(self) -> pb.ModelInfoReply:
        return pb.ModelInfoReply(model="tiny", max_context=4096, dtype="bfloat16", device="cpu")

    async def health_status(self, service: str = "", timeout_s: float = 2.0) -> str:
        return "NOT_SERVING"

    async def close(self) -> None:
        pass


def send(script: list, method: str, path: str, config: GatewayConfig | None = None, **kwargs) -> tuple[httpx.Response, FakeUpstream]:
    upstream = FakeUpstream(script)
    app = build_app(config or GatewayConfig())
    app.state.gateway.upstream = upstream  # the lifespan (which would open a channel) does not run here

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go()), upstream


def sse_data(response: httpx.Response) -> list:
    return [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("code, status", [(grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.UNAUTHENTICATED, 401),
                                          (grpc.StatusCode.NOT_FOUND, 404), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                                          (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.DEADLINE_EXCEEDED, 504)])
@pytest.mark.parametrize("stream", [False, True])
def test_grpc_failures_before_the_first_token_are_http_statuses(code, status, stream):
    response, upstream = send([rpc_error(code)], "POST", "/v1/chat/completions", json={**CHAT, "stream": stream})
    assert response.status_code == status
    assert response.json()["error"]["message"] == "details"
    assert ("retry-after" in response.headers) == (status == 429)
    assert upstream.calls[0].cancelled


def test_an_error_after_streaming_began_is_an_error_chunk_then_done():
    response, upstream = send([token("He", 1), rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "too slow")],
                              "POST", "/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    data = sse_data(response)
    assert [json.loads(item)["choices"][0]["delta"] for item in data[:2]] == [
        {"role": "assistant", "content": ""}, {"content": "He"}]
    assert json.loads(data[2]) == {"error": {"message": "too slow", "type": "server_error", "param": None,
                                             "code": "timeout"}}
    assert data[3:] == ["[DONE]"]
    assert upstream.calls[0].cancelled


def test_non_streaming_chat_is_assembled_with_usage():
    response, upstream = send([token("Hi", 1), result(generated=1, finish="eos")], "POST", "/v1/chat/completions",
                              json={**CHAT, "temperature": 0}, headers={"X-Request-Id": "given-id"})
    body = response.json()
    assert body["id"] == "chatcmpl-given-id" and response.headers["x-request-id"] == "given-id"
    assert upstream.requests[0].request_id == "given-id"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


@pytest.mark.parametrize("kwargs, fragment", [
    ({"content": b"{oops", "headers": {"content-type": "application/json"}}, "Invalid JSON"),
    ({"content": b""}, "empty"),
    ({"json": {"model": "tiny"}}, "messages: Field required"),
    ({"json": {**CHAT, "temperature": -1}}, "temperature"),
    ({"json": {**CHAT, "n": 17}}, "n:"),
])
def test_bad_bodies_are_400_never_422(kwargs, fragment):
    response, upstream = send([], "POST", "/v1/chat/completions", **kwargs)
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "invalid_request_error" and not upstream.calls


def test_another_model_name_is_404_model_not_found():
    response, _ = send([], "POST", "/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_served_model_name_is_listed_and_accepted():
    config = GatewayConfig(served_model_name="my-model")
    listed, _ = send([], "GET", "/v1/models", config=config)
    assert listed.json()["data"][0]["id"] == "my-model" and listed.json()["data"][0]["max_model_len"] == 4096
    response, _ = send([token("x", 1), result()], "POST", "/v1/completions", config=config,
                       json={"model": "my-model", "prompt": "a"})
    assert response.status_code == 200 and response.json()["model"] == "my-model"


def test_models_reports_the_services_dtype_and_device():
    listed, _ = send([], "GET", "/v1/models")
    entry = listed.json()["data"][0]
    assert (entry["dtype"], entry["device"]) == ("bfloat16", "cpu")


def test_unknown_routes_and_methods_are_openai_shaped():
    missing, _ = send([], "GET", "/v1/nothing")
    wrong_method, _ = send([], "GET", "/v1/chat/completions")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_api_key_guards_everything_but_health_and_metrics(tmp_path):
    (tmp_path / "key").write_text("sk-test\n")
    config = GatewayConfig(api_key_file=str(tmp_path / "key"))
    refused, _ = send([], "POST", "/v1/chat/completions", config=config, json=CHAT)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    accepted, _ = send([token("x", 1), result()], "POST", "/v1/chat/completions", config=config, json=CHAT,
                       headers={"Authorization": "Bearer sk-test"})
    assert accepted.status_code == 200
    health, _ = send([], "GET", "/health", config=config)
    assert health.status_code == 503 and health.json()["service"] == "NOT_SERVING"  # open, and honest
    metrics, _ = send([], "GET", "/metrics", config=config)
    assert metrics.status_code == 200 and b"kvboost_gateway_requests_total" in metrics.content
