"""The gateway under 2,000 random, extreme and malformed requests on the tiny model: every one answered, none
with a 5xx, and an ordinary request before and after gives the same answer."""
from __future__ import annotations

import json
import random
from contextlib import ExitStack

import httpx
import pytest

from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.e2e.gateway_process import running_gateways
from tests.e2e.service_process import running_service
from tests.e2e.stack_process import save_tiny_model

NUM_REQUESTS = 2000
INTEGERS = [-2**64, -2**63 - 1, -2**31, -1, 0, 1, 2, 3, 4, 255, 259, 260, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63,
            2**64, 10**30]
FLOATS = [0.0, 1e-45, 1e-40, 1e-30, 1e-7, 1e-6, 0.5, 1.0, 2.0, 100.0, 101.0, -0.5, 1e308, float("inf"),
          float("-inf"), float("nan")]
STRINGS = ["", "x", "stop", "\u0000", "\ud7ff" * 3, "a" * 5000, "<|im_end|>"]
FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
          "stop_token_ids", "min_tokens", "ignore_eos", "logprobs", "top_logprobs", "stream", "cache_salt", "echo",
          "user", "kvboost"]
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rng.choice(INTEGERS)
    if kind == 1:
        return rng.choice(FLOATS)
    if kind == 2:
        return rng.choice(STRINGS)
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.randint(-3, 10)
    if kind == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELDS + ["mode", "segments", "recompute_ratio", "sink_tokens"]): random_value(rng, depth + 1)
            for _ in range(rng.randrange(3))}


def random_body(rng: random.Random, endpoint: str) -> str | bytes:
    if rng.random() < 0.05:  # not JSON, or not an object
        return rng.choice([b"{", b"\xff\xfe", b"[]", b"null", b"42", b'{"messages": ', b"\x00" * 10])
    body: dict = {"model": rng.choice(["tiny", None, 5, ""])} if rng.random() < 0.5 else {}
    if endpoint == "/v1/chat/completions":
        body["messages"] = rng.choice([[{"role": "user", "content": "Hi there"}], [], [{"role": "robot"}],
                                       [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                       random_value(rng)])
    elif endpoint == "/v1/completions":
        body["prompt"] = rng.choice(["Hello", [5, 6, 7], [[1, 2]], [-1, 2**40], "", random_value(rng)])
    elif endpoint == "/tokenize":
        body["prompt"] = rng.choice(["Hello", None, 7, random_value(rng)])
    else:
        body["tokens"] = rng.choice([[72, 105], [-1], [2**32], [2**70], [], random_value(rng)])
    body["max_tokens"] = rng.choice([1, 2, 3, 4])  # keep the model's work small...
    if rng.random() < 0.3:  # a third are ordinary requests with extreme values that are still valid
        body.update(temperature=rng.choice([0, 1e-6, 2.0, 100.0]), top_k=rng.choice([-1, 0, 1, 2**31]),
                    seed=rng.choice([0, 2**63, -2**63, 2**64 - 1]), top_p=rng.choice([1e-9, 1.0]))
        return json.dumps(body)
    for _ in range(rng.randrange(6)):  # ...and the rest anything
        body[rng.choice(FIELDS)] = random_value(rng)
    return json.dumps(body, allow_nan=True)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gateway-fuzz")
    model_dir = save_tiny_model(folder / "tiny-model")
    daemon = start_daemon(folder / "lmdb", pick_free_port())
    try:
        with ExitStack() as stack:
            service = stack.enter_context(running_service(str(model_dir), daemon.address, pick_free_port(),
                                                          folder / "service.log", "--chunk-size", "8"))
            (gateway,) = stack.enter_context(running_gateways((service.address, pick_free_port(),
                                                               folder / "gateway.log")))
            yield gateway
    finally:
        daemon.terminate()


@pytest.mark.e2e
def test_random_extreme_and_malformed_requests_never_get_a_5xx(gateway):
    rng = random.Random(20261124)
    ordinary = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "temperature": 0}
    statuses: dict[int, int] = {}
    failures = []
    with httpx.Client(base_url=gateway.base_url, timeout=60) as client:
        before = client.post("/v1/chat/completions", json=ordinary).json()["choices"][0]["message"]["content"]
        for index in range(NUM_REQUESTS):
            endpoint = rng.choice(ENDPOINTS)
            body = random_body(rng, endpoint)
            response = client.post(endpoint, content=body, headers={"content-type": "application/json"})
            response.read()
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append((endpoint, body[:300], response.status_code, response.text[:300]))
        after = client.post("/v1/chat/completions", json=ordinary).json()["choices"][0]["message"]["content"]
    assert sum(statuses.values()) == NUM_REQUESTS, "every request answered"
    assert failures == [], f"{len(failures)} responses >= 500, first: {failures[:3]}; by status {statuses}"
    assert statuses.get(400, 0) > NUM_REQUESTS // 4 and statuses.get(200, 0) > NUM_REQUESTS // 20, statuses
    assert after == before, "an ordinary request answers the same after the flood"
