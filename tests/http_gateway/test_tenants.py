"""The gateway's callers in process, with a fake upstream: API keys mapped to tenants and their cache scopes,
pins and unpins for admin keys only, the body and concurrency limits, and sizes that can never fit.
(tests/e2e/test_gateway_tenants.py runs the same against real processes, over HTTPS.)"""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from http_gateway.app import build_app
from http_gateway.auth import Caller, Keys
from http_gateway.config import GatewayConfig, parse_config
from kvboost.v1 import inference_pb2 as pb
from kvboost_common.principals import Principal
from tests.http_gateway.factories import result, token
from tests.http_gateway.test_app import CHAT, FakeUpstream, rpc_error

KEYS = {"alice": "alice-key-1f0c", "bob": "bob-key-77e2", "ops": "ops-key-c9d4"}


@pytest.fixture
def keys_file(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {
        "alice": {"token": KEYS["alice"]}, "bob": {"token": KEYS["bob"]}, "ops": {"token": KEYS["ops"], "admin": True},
    }}))
    return str(path)


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


class RecordingUpstream(FakeUpstream):
    """Also answers Warm and Unpin, recording what was sent."""

    def __init__(self, script: list) -> None:
        super().__init__(script)
        self.warms: list[pb.WarmRequest] = []
        self.unpins: list[pb.WarmRequest] = []

    async def warm(self, request: pb.WarmRequest) -> pb.WarmResult:
        self.warms.append(request)
        return pb.WarmResult(chunks_stored=2, token_count=40, chunk_size=16)

    async def unpin(self, request: pb.WarmRequest) -> pb.UnpinResult:
        self.unpins.append(request)
        return pb.UnpinResult(chunks_unpinned=3, token_count=40)


def calls(config: GatewayConfig, requests: list[tuple], script: list | None = None,
          upstream: FakeUpstream | None = None) -> tuple[list[httpx.Response], FakeUpstream]:
    """(method, path, kwargs) requests one after another against one app."""
    upstream = upstream or RecordingUpstream(script if script is not None else [token("ok", 5), result()])
    app = build_app(config)
    app.state.gateway.upstream = upstream

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return [await client.request(method, path, **kwargs) for method, path, kwargs in requests]

    return asyncio.run(go()), upstream


def test_each_key_speaks_for_its_tenant_and_sets_the_cache_scope(keys_file) -> None:
    config = GatewayConfig(keys_file=keys_file)
    chat = {**CHAT, "max_tokens": 5}
    responses, upstream = calls(config, [
        ("POST", "/v1/chat/completions", {"json": chat}),
        ("POST", "/v1/chat/completions", {"json": chat, "headers": {"Authorization": "Bearer nobody"}}),
        ("POST", "/v1/chat/completions", {"json": chat, "headers": bearer("alice")}),
        ("POST", "/v1/chat/completions", {"json": {**chat, "cache_salt": "s1"}, "headers": bearer("alice")}),
        ("POST", "/v1/completions", {"json": {"prompt": "p", "max_tokens": 5}, "headers": bearer("bob")}),
        # bob names alice's derived salt as his own: it lands inside his scope, not hers.
        ("POST", "/v1/completions", {"json": {"prompt": "p", "max_tokens": 5, "cache_salt": "tenant=alice;salt="},
                                     "headers": bearer("bob")}),
        ("GET", "/health", {}),  # open
    ], script=[token("ok", 5), result()])
    assert [response.status_code for response in responses[:2]] == [401, 401]
    assert responses[0].json()["error"]["code"] == "invalid_api_key"
    assert [response.status_code for response in responses[2:6]] == [200] * 4
    assert responses[6].status_code == 503  # the fake service is NOT_SERVING; no key needed
    salts = [request.cache_salt for request in upstream.requests]
    assert salts == ["tenant=alice;salt=", "tenant=alice;salt=s1", "tenant=bob;salt=", "tenant=bob;salt=tenant=alice;salt="]
    assert len(set(salts)) == 4


def test_no_client_salt_reaches_another_tenants_scope() -> None:
    alice, bob = Caller("alice", False), Caller("bob", False)
    tricky = ["", "x", "tenant=alice;salt=", ";salt=", "alice", "tenant=bob;salt=x", "\x00", "tenant=alice"]
    alice_scopes = {alice.cache_salt(salt) for salt in tricky}
    bob_scopes = {bob.cache_salt(salt) for salt in tricky}
    assert not alice_scopes & bob_scopes
    assert len(alice_scopes) == len(tricky)  # a tenant's own salts still keep its requests apart


def test_pins_and_other_tenants_scopes_need_an_admin_key(keys_file) -> None:
    config = GatewayConfig(keys_file=keys_file)
    text = {"text": "a document"}
    responses, upstream = calls(config, [
        ("POST", "/v1/kvboost/warm", {"json": {**text, "pin": True}, "headers": bearer("alice")}),
        ("POST", "/v1/kvboost/warm", {"json": {**text, "tenant": "bob"}, "headers": bearer("alice")}),
        ("POST", "/v1/kvboost/unpin", {"json": text, "headers": bearer("alice")}),
        ("POST", "/v1/kvboost/warm", {"json": text, "headers": bearer("alice")}),
        ("POST", "/v1/kvboost/warm", {"json": {**text, "pin": True, "tenant": "alice"}, "headers": bearer("ops")}),
        ("POST", "/v1/kvboost/warm", {"json": {**text, "tenant": "carol"}, "headers": bearer("ops")}),
        ("POST", "/v1/kvboost/unpin", {"json": {**text, "tenant": "alice"}, "headers": bearer("ops")}),
    ])
    statuses = [response.status_code for response in responses]
    assert statuses == [403, 403, 403, 200, 200, 400, 200]
    assert responses[0].json()["error"] == {
        "message": "pinned chunks are never evicted, so pinning needs an admin key; warm without `pin`",
        "type": "permission_error", "param": "pin", "code": "permission_denied"}
    assert "carol" in responses[5].json()["error"]["message"]
    assert [(warm.pin, warm.cache_salt) for warm in upstream.warms] == [(False, "tenant=alice;salt="),
                                                                         (True, "tenant=alice;salt=")]
    assert [(unpin.text, unpin.cache_salt) for unpin in upstream.unpins] == [("a document", "tenant=alice;salt=")]
    assert responses[6].json() == {"object": "kvboost.unpin", "chunks_unpinned": 3, "token_count": 40}


def test_without_tenants_one_key_or_none_is_trusted_as_before(tmp_path) -> None:
    (tmp_path / "key").write_text("the-one-key\n")
    responses, upstream = calls(GatewayConfig(api_key_file=str(tmp_path / "key")), [
        ("POST", "/v1/kvboost/warm", {"json": {"text": "t", "pin": True, "cache_salt": "s"}}),
        ("POST", "/v1/kvboost/warm", {"json": {"text": "t", "pin": True, "cache_salt": "s"},
                                      "headers": {"Authorization": "Bearer the-one-key"}}),
        ("POST", "/v1/kvboost/warm", {"json": {"text": "t", "tenant": "x"},
                                      "headers": {"Authorization": "Bearer the-one-key"}}),
    ])
    assert [response.status_code for response in responses] == [401, 200, 400]
    assert "--keys-file" in responses[2].json()["error"]["message"]
    assert [(warm.pin, warm.cache_salt) for warm in upstream.warms] == [(True, "s")]


def test_a_body_over_the_limit_is_413_declared_or_chunked() -> None:
    config = GatewayConfig(max_body_bytes=2048)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}

    async def chunked():  # no Content-Length: the limit is counted as the body arrives
        payload = json.dumps(big).encode()
        for start in range(0, len(payload), 512):
            yield payload[start:start + 512]

    responses, upstream = calls(config, [
        ("POST", "/v1/chat/completions", {"json": big}),
        ("POST", "/v1/chat/completions", {"content": chunked()}),
        ("POST", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": 5}}),
    ])
    assert [response.status_code for response in responses] == [413, 413, 200]
    assert all(response.json()["error"]["code"] == "request_too_large" for response in responses[:2])
    assert "--max-body-bytes" in responses[0].json()["error"]["message"]
    assert len(upstream.requests) == 1


class BlockingUpstream(RecordingUpstream):
    """Generate calls that hang until released, to hold requests in flight."""

    def __init__(self) -> None:
        super().__init__([])
        self.release = asyncio.Event()
        self.two_held = asyncio.Event()

    def generate(self, request: pb.GenerateRequest):
        self.requests.append(request)
        if len(self.requests) >= 2:
            self.two_held.set()
        release = self.release

        class Held:
            def __init__(self) -> None:
                self.script = [token("ok", 5), result()]

            async def read(self):
                await release.wait()
                return self.script.pop(0) if self.script else grpc.aio.EOF

            def cancel(self) -> bool:
                return True
        return Held()


def test_requests_over_the_concurrency_limit_get_429_and_later_ones_pass() -> None:
    upstream = BlockingUpstream()
    app = build_app(GatewayConfig(max_concurrent_requests=2, retry_after_s=3))
    app.state.gateway.upstream = upstream
    body = {**CHAT, "max_tokens": 5}

    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            held = [asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(2)]
            await upstream.two_held.wait()
            refused = await client.post("/v1/chat/completions", json=body)
            health = await client.get("/health")  # probes are never counted or refused
            upstream.release.set()
            done = await asyncio.gather(*held)
            after = await client.post("/v1/chat/completions", json=body)
            return refused, health, done, after

    refused, health, done, after = asyncio.run(go())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
    assert "--max-concurrent-requests" in refused.json()["error"]["message"]
    assert health.status_code == 503
    assert [response.status_code for response in done] == [200, 200]
    assert after.status_code == 200


@pytest.mark.parametrize("code, details, status, error_code", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (70000000 vs. 67108864)", 413,
     "request_too_large"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "every place in the queue is taken", 429, "rate_limit_exceeded"),
    (grpc.StatusCode.INVALID_ARGUMENT, "the context holds 8192 tokens, but 9000 were asked for", 400,
     "context_length_exceeded"),
])
def test_what_can_never_fit_is_not_a_429(code, details, status, error_code) -> None:
    responses, _ = calls(GatewayConfig(), [("POST", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": 5}})],
                         script=[rpc_error(code, details)])
    assert responses[0].status_code == status
    assert responses[0].json()["error"]["code"] == error_code
    assert ("retry-after" in responses[0].headers) == (status == 429)


def test_a_clients_max_tokens_is_held_to_the_context_and_the_default_is_capped() -> None:
    _, upstream = calls(GatewayConfig(), [
        ("POST", "/v1/chat/completions", {"json": {**CHAT, "max_tokens": 5}}),
        ("POST", "/v1/chat/completions", {"json": CHAT}),
        ("POST", "/v1/completions", {"json": {"prompt": "p", "max_tokens": 5}}),
        ("POST", "/v1/completions", {"json": {"prompt": "p"}}),
    ], script=[token("ok", 5), result()])
    assert [request.strict_context for request in upstream.requests] == [True, False, True, False]


def test_keys_and_listener_flags(tmp_path, keys_file) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--api-key-file", "k", "--keys-file", keys_file], {})
    with pytest.raises(SystemExit):
        parse_config(["--https-cert", "c.pem"], {})
    with pytest.raises(SystemExit):
        parse_config(["--max-concurrent-requests", "0"], {})
    config = parse_config([], {"KVBOOST_GATEWAY_KEYS_FILE": keys_file, "KVBOOST_GATEWAY_MAX_BODY_BYTES": "4096"})
    assert (config.keys_file, config.max_body_bytes) == (keys_file, 4096)
    assert config.keys().tenant_names == ["alice", "bob", "ops"]
    (tmp_path / "shared.json").write_text(json.dumps({"tenants": {"a": {"token": "t"}, "b": {"token": "t"}}}))
    with pytest.raises(ValueError, match="share a token"):
        GatewayConfig(keys_file=str(tmp_path / "shared.json")).keys()


def test_keys_compare_whole_bearer_values() -> None:
    keys = Keys(tenants={"k1": Principal("a"), "k2": Principal("b", admin=True)})
    assert keys.caller(b"Bearer k1") == Caller("a", False)
    assert keys.caller(b"Bearer k2") == Caller("b", True)
    assert [keys.caller(value) for value in (b"", b"k1", b"Bearer k", b"Bearer k1 ", b"bearer k1")] == [None] * 5
    assert Keys().caller(b"") == Caller(None, True)
