"""The gateway with a keys file, over HTTPS, in front of a real service and daemon (tiny model), used through
the `openai` package: each tenant's cache scope is its own end to end, pins and unpins need an admin key and
reach the daemon, a prompt plus max_tokens beyond the context is a 400, an oversized body a 413."""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from kvboost.v1 import cache_pb2

from tests.certificates import make_certificate, requires_openssl
from tests.conftest import pick_free_port
from tests.daemon_support import cache_stub
from tests.e2e.daemon_process import start_daemon
from tests.e2e.gateway_process import GatewayProcess, running_gateways
from tests.e2e.service_process import running_service
from tests.e2e.stack_process import save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240), requires_openssl]

KEYS = {"alice": "alice-0c41d9", "bob": "bob-5be2a0", "ops": "ops-93fd17"}
DOCUMENT = "The ferry to the outer islands leaves at seven, returns at noon, and skips Sundays in winter. " * 3
QUESTION = " Q: when does the ferry leave?"
MAX_BODY_BYTES = 65536


@dataclass
class Stack:
    gateway: GatewayProcess
    daemon_address: str
    cert: Path
    model: str

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway.base_url}/v1", api_key=KEYS[name], max_retries=0, timeout=120,
                             http_client=httpx.Client(verify=str(self.cert)))

    def post(self, name: str, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.gateway.base_url}{path}", json=body, timeout=120, verify=str(self.cert),
                          headers={"Authorization": f"Bearer {KEYS[name]}"})

    def complete(self, name: str, prompt: str, **extra) -> tuple[str, int]:
        """Exact prefix hits only (a content hit of a tenant's own earlier chunks would blur what is counted)."""
        extra = {"kvboost": {"mode": "prefix_cache"}, **extra}
        with self.client(name) as client:  # closed: a kept-alive connection holds the gateway's shutdown 10 s
            reply = client.completions.create(model=self.model, prompt=prompt, max_tokens=6, temperature=0,
                                              extra_body=extra)
        return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens

    def pinned(self) -> int:
        with cache_stub(self.daemon_address) as cache:
            stats = cache.Stats(cache_pb2.CacheStatsRequest(), timeout=10)
        return sum(namespace.pinned for namespace in stats.namespaces)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    folder = tmp_path_factory.mktemp("gateway-tenants")
    model_dir = save_tiny_model(folder / "tiny-model")
    cert, key = make_certificate(folder)
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps({"tenants": {
        "alice": {"token": KEYS["alice"]}, "bob": {"token": KEYS["bob"]}, "ops": {"token": KEYS["ops"], "admin": True},
    }}))
    daemon = start_daemon(folder / "lmdb", pick_free_port())
    try:
        with ExitStack() as stack:
            service = stack.enter_context(running_service(str(model_dir), daemon.address, pick_free_port(),
                                                          folder / "service.log", "--chunk-size", "8"))
            gateway, = stack.enter_context(running_gateways(
                (service.address, pick_free_port(), folder / "gateway.log", "--keys-file", str(keys_file),
                 "--https-cert", str(cert), "--https-key", str(key), "--max-body-bytes", str(MAX_BODY_BYTES))))
            yield Stack(gateway, daemon.address, cert, str(model_dir))
    finally:
        daemon.terminate()


def test_a_tenant_reuses_its_own_warm_up_and_no_other_tenant_sees_it(stack):
    warmed = stack.post("alice", "/v1/kvboost/warm", {"text": DOCUMENT})
    assert warmed.status_code == 200, warmed.text
    assert warmed.json()["chunks_stored"] >= 3
    alice_text, alice_cached = stack.complete("alice", DOCUMENT + QUESTION)
    bob_text, bob_cached = stack.complete("bob", DOCUMENT + QUESTION)
    # bob names alice's scope as his salt, and asks for the server-wide scope: neither is hers.
    forged_text, forged_cached = stack.complete("bob", DOCUMENT + QUESTION, cache_salt="tenant=alice;salt=")
    baseline_text, _ = stack.complete("alice", DOCUMENT + QUESTION, kvboost={"mode": "baseline"})
    assert alice_cached >= 8 * (warmed.json()["token_count"] // 8) - 8  # the document's whole chunks, at least
    assert (bob_cached, forged_cached) == (0, 0)
    assert alice_text == bob_text == forged_text == baseline_text
    # bob's own history is his: his second call reuses what his first stored.
    _, bob_again = stack.complete("bob", DOCUMENT + QUESTION)
    assert bob_again > 0


def test_pins_go_through_an_admin_key_into_a_tenants_scope_and_unpin_clears_them(stack):
    # Shares no chunk with DOCUMENT, which bob's own requests stored (content hits would find those).
    document = "Tram tickets are sold at every stop, cost two crowns, and are valid for ninety minutes. " * 3
    assert stack.post("alice", "/v1/kvboost/warm", {"text": document, "pin": True}).status_code == 403
    assert stack.post("bob", "/v1/kvboost/warm", {"text": document, "tenant": "alice"}).status_code == 403
    before = stack.pinned()
    pinned = stack.post("ops", "/v1/kvboost/warm", {"text": document, "pin": True, "tenant": "alice"})
    assert pinned.status_code == 200, pinned.text
    chunks = pinned.json()["chunks_stored"]  # whole chunks and the partial tail
    assert stack.pinned() == before + chunks
    _, alice_cached = stack.complete("alice", document + QUESTION)
    _, bob_cached = stack.complete("bob", document + QUESTION)
    # Bob's own DOCUMENT starts with the same letter: reuse to the last shared token may take that one token.
    assert alice_cached > 8 and bob_cached <= 1, "the admin warmed alice's scope, not bob's"
    assert stack.post("alice", "/v1/kvboost/unpin", {"text": document}).status_code == 403
    unpinned = stack.post("ops", "/v1/kvboost/unpin", {"text": document, "tenant": "alice"})
    assert unpinned.status_code == 200, unpinned.text
    assert unpinned.json()["chunks_unpinned"] == chunks
    assert stack.pinned() == before


def test_context_overflow_is_400_and_an_oversized_body_413(stack):
    with stack.client("alice") as client:
        check_context_overflow_and_body_size(stack, client)


def check_context_overflow_and_body_size(stack, client):
    context = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as overflow:
        client.completions.create(model=stack.model, prompt=QUESTION, max_tokens=context, temperature=0)
    assert overflow.value.code == "context_length_exceeded"
    assert "shorten the prompt or lower max_new_tokens" in overflow.value.message
    with pytest.raises(openai.APIStatusError) as too_large:
        client.completions.create(model=stack.model, prompt="x" * MAX_BODY_BYTES, max_tokens=1)
    assert too_large.value.status_code == 413
    # The default max_tokens of a chat is capped by the context instead, as before.
    reply = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": QUESTION}],
                                           temperature=0)
    assert reply.usage.completion_tokens > 0


def test_wrong_or_missing_keys_and_plain_http_are_refused(stack):
    assert httpx.post(f"{stack.gateway.base_url}/v1/completions", json={"prompt": "x"}, verify=str(stack.cert),
                      timeout=30).status_code == 401
    with openai.OpenAI(base_url=f"{stack.gateway.base_url}/v1", api_key="not-a-key", max_retries=0,
                       http_client=httpx.Client(verify=str(stack.cert))) as client, \
            pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(httpx.HTTPError):  # the listener speaks TLS only
        httpx.get(stack.gateway.base_url.replace("https://", "http://") + "/health", timeout=10)
