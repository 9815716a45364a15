"""The gateway in front of the real SmolLM2: the openai SDK gets gRPC Generate's greedy answer, and a follow-up
question on the same system prompt reports the reused tokens in usage.prompt_tokens_details.cached_tokens."""
from __future__ import annotations

import time

import grpc
import openai
import pytest

from inference_service.model.weights import DEFAULT_MODEL
from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.e2e.gateway_process import running_gateways
from tests.e2e.service_process import running_service

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

SYSTEM = ("You are the help desk of the Harbour Town ferry service. Answer in one short sentence.\n"
          + "\n".join(f"Rule {i}: the ferry to pier {i} leaves at {6 + i % 12}:{(i * 7) % 60:02d}." for i in range(24)))


def test_smollm2_through_the_gateway_equals_grpc_and_reports_cached_tokens(tmp_path):
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port())
    try:
        with running_service(DEFAULT_MODEL, daemon.address, pick_free_port(), tmp_path / "service.log",
                             timeout_s=180) as service, \
                running_gateways((service.address, pick_free_port(), tmp_path / "gateway.log")) as (gateway,):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When does pier 3 leave?"}]
            with grpc.insecure_channel(service.address) as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                expected = list(stub.Generate(pb.GenerateRequest(
                    messages=[pb.ChatMessage(**m) for m in messages], max_new_tokens=16, temperature=0,
                    mode=pb.BASELINE), timeout=120))[-1].result
            client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                   extra_body={"kvboost": {"mode": "prefix_cache"}})
            assert reply.choices[0].message.content == expected.output_text
            assert reply.usage.prompt_tokens == expected.prompt_tokens

            follow_up = [messages[0], {"role": "user", "content": "And pier 5?"}]
            deadline = time.monotonic() + 60
            while True:  # the first call's chunks are written back in the background
                again = client.chat.completions.create(model=model, messages=follow_up, max_tokens=4, temperature=0,
                                                       extra_body={"kvboost": {"mode": "prefix_cache"}})
                if again.usage.prompt_tokens_details.cached_tokens or time.monotonic() > deadline:
                    break
            assert again.usage.prompt_tokens_details.cached_tokens >= 128 * 4
    finally:
        daemon.terminate()
