"""The promise, property-tested through real processes (cache daemon, inference service with a tiny model, HTTP
gateway used with the `openai` package): by default every answer, over gRPC or HTTP, streamed or not, is plain
`model.generate`'s and says `approximate: false`; with approximate reuse asked for, every surface says the same
`approximate` for the same answer, and an answer that does not say it is still exact."""
from __future__ import annotations

import itertools
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import grpc
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from tests.conftest import pick_free_port, wait_for
from tests.e2e.gateway_process import GatewayProcess, running_gateways
from tests.e2e.service_process import ServiceProcess
from tests.e2e.tiny_stack import tiny_daemon_and_service
from tests.repetitive_prompts import Workload, chat_workloads, workloads

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_NEW_TOKENS = 6
CHUNK_SIZE = 8
STACK_SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.function_scoped_fixture])
_salts = itertools.count()


@dataclass
class Stack:
    service: ServiceProcess
    gateway: GatewayProcess
    model_dir: Path
    channel: grpc.Channel

    @property
    def stub(self) -> inference_pb2_grpc.InferenceServiceStub:
        return inference_pb2_grpc.InferenceServiceStub(self.channel)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

    def generate(self, **fields) -> tuple[list[pb.GenerateEvent], pb.GenerationResult]:
        events = list(self.stub.Generate(pb.GenerateRequest(max_new_tokens=MAX_NEW_TOKENS, **fields), timeout=60))
        assert events and events[-1].HasField("result")
        return events[:-1], events[-1].result


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    folder = tmp_path_factory.mktemp("exact-by-default")
    with ExitStack() as context:
        _, service, model_dir = context.enter_context(tiny_daemon_and_service(
            folder, "--chunk-size", str(CHUNK_SIZE)))  # no --default-mode: the shipped default
        gateway, = context.enter_context(running_gateways((service.address, pick_free_port(), folder / "gateway.log")))
        channel = context.enter_context(grpc.insecure_channel(service.address))
        yield Stack(service, gateway, model_dir, channel)


@lru_cache(maxsize=1)
def plain_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


@lru_cache(maxsize=4096)
def _generate(model_dir: Path, token_ids: tuple[int, ...]) -> list[int]:
    model, _ = plain_model(model_dir)
    input_ids = torch.tensor([token_ids])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=MAX_NEW_TOKENS)
    return output[0, len(token_ids):].tolist()


def reference(model_dir: Path, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """Plain transformers greedy output for a prompt or a conversation: the ground truth."""
    tokenizer = plain_model(model_dir)[1]
    if messages is not None:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return _generate(model_dir, tuple(ids))


def first_token_event(events: list[pb.GenerateEvent]) -> pb.GenerateEvent:
    return next(event for event in events if event.token_ids)


def kvboost_of(reply) -> dict:
    return reply.model_extra["kvboost"]


@STACK_SETTINGS
@given(workload=workloads(max_chars=240))
def test_default_mode_is_model_generate_over_grpc_and_http(stack, workload: Workload):
    salt = f"default-{next(_salts)}-{uuid.uuid4().hex[:8]}"
    client = stack.openai()
    for prompt in workload.asked():
        expected = reference(stack.model_dir, prompt)
        events, result = stack.generate(prompt=prompt, cache_salt=salt)
        assert result.mode == pb.PREFIX_CACHE
        assert list(result.output_token_ids) == expected, f"prompt {prompt!r} after {workload.asked()!r}"
        assert not result.approximate and not any(event.approximate for event in events)
        reply = client.completions.create(model=str(stack.model_dir), prompt=prompt, max_tokens=MAX_NEW_TOKENS,
                                          temperature=0, extra_body={"cache_salt": salt})
        assert reply.choices[0].text == result.output_text
        assert kvboost_of(reply)["approximate"] is False and kvboost_of(reply)["mode"] == "prefix_cache"
        streamed = list(client.completions.create(model=str(stack.model_dir), prompt=prompt,
                                                  max_tokens=MAX_NEW_TOKENS, temperature=0, stream=True,
                                                  extra_body={"cache_salt": salt}))
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == result.output_text
        labelled = [chunk.model_extra["kvboost"] for chunk in streamed if chunk.model_extra.get("kvboost")]
        assert labelled and all(label["approximate"] is False for label in labelled)


@STACK_SETTINGS
@given(conversations=chat_workloads())
def test_default_mode_chat_is_model_generate_over_http(stack, conversations):
    salt = f"chat-{next(_salts)}-{uuid.uuid4().hex[:8]}"
    client = stack.openai()
    tokenizer = plain_model(stack.model_dir)[1]
    for messages in conversations + conversations[:1]:  # the first conversation again at the end
        expected_text = tokenizer.decode(reference(stack.model_dir, messages=messages), skip_special_tokens=True)
        reply = client.chat.completions.create(model=str(stack.model_dir), messages=messages, temperature=0,
                                               max_tokens=MAX_NEW_TOKENS, extra_body={"cache_salt": salt})
        details = kvboost_of(reply)
        if reply.choices[0].finish_reason == "length":  # an EOS is not in the text: compare where none came
            assert reply.choices[0].message.content == expected_text
        assert details["approximate"] is False and details["approximate_tokens"] == 0
        _, result = stack.generate(messages=[pb.ChatMessage(**message) for message in messages], cache_salt=salt)
        assert list(result.output_token_ids) == reference(stack.model_dir, messages=messages)
        assert result.output_text == reply.choices[0].message.content


@STACK_SETTINGS
@given(workload=workloads(max_chars=240))
def test_opt_in_is_labelled_alike_on_every_surface(stack, workload: Workload):
    salt = f"opt-in-{next(_salts)}-{uuid.uuid4().hex[:8]}"
    client = stack.openai()
    num_approximate = 0
    for prompt in workload.asked():
        events, result = stack.generate(prompt=prompt, cache_salt=salt, mode=pb.CHUNK_KV_REUSE)
        num_approximate += result.approximate
        first = first_token_event(events)
        assert (first.approximate, first.approximate_tokens) == (result.approximate, result.approximate_tokens)
        if not result.approximate:
            assert list(result.output_token_ids) == reference(stack.model_dir, prompt)
            assert result.approximate_tokens == 0
        streamed = list(client.completions.create(
            model=str(stack.model_dir), prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0, stream=True,
            extra_body={"cache_salt": salt, "kvboost": {"mode": "chunk_kv_reuse"}}))
        labelled = [chunk.model_extra["kvboost"] for chunk in streamed if chunk.model_extra.get("kvboost")]
        # The first content chunk and the finish chunk say the same of the one answer.
        assert len(labelled) == 2, labelled
        assert labelled[0]["approximate"] == labelled[-1]["approximate"]
        assert labelled[0]["approximate_tokens"] == labelled[-1]["approximate_tokens"]
        num_approximate += labelled[-1]["approximate"]
        if not labelled[-1]["approximate"]:
            text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
            _, baseline = stack.generate(prompt=prompt, mode=pb.BASELINE)
            assert list(baseline.output_token_ids) == reference(stack.model_dir, prompt)
            assert text == baseline.output_text
    # The service counts every approximate answer (the counter is the service's, shared with other examples).
    assert stack.stub.Stats(pb.ServiceStatsRequest(), timeout=10).approximate_answers >= num_approximate


def test_model_info_says_the_default_mode(stack):
    assert stack.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).default_mode == pb.PREFIX_CACHE


def test_the_repetitive_prompt_of_the_issue_over_http(stack):
    """'0 ' + 'hi ' * N asked, then '3 ' + the same body: by default the second answer is BASELINE's, nothing
    reused (no exact prefix); asked for chunk_kv_reuse, it reuses the body by content and says approximate on the
    answer, the first streamed content chunk and the last."""
    salt = uuid.uuid4().hex
    client = stack.openai()
    body = "hi " * 200

    def complete(prompt: str, **kvboost):
        return client.completions.create(model=str(stack.model_dir), prompt=prompt, max_tokens=MAX_NEW_TOKENS,
                                         temperature=0, extra_body={"cache_salt": salt, "kvboost": kvboost})

    stored = stack.stub.Stats(pb.ServiceStatsRequest(), timeout=10).chunks_stored
    complete("0 " + body)
    # Its chunks are written back after its answer, in the background: the content hits below need them stored.
    wait_for(lambda: stack.stub.Stats(pb.ServiceStatsRequest(), timeout=10).chunks_stored > stored,
             "the first prompt's chunks to reach the daemon")
    exact = complete("3 " + body)
    _, baseline = stack.generate(prompt="3 " + body, mode=pb.BASELINE)
    assert exact.choices[0].text == baseline.output_text
    assert exact.usage.prompt_tokens_details.cached_tokens == 0 and kvboost_of(exact)["approximate"] is False
    # Repair by `none` keeps every content-hit token (selective, the default, may recompute them all here: the answer
    # is still labelled, since it came through the repair path, but approximate_tokens is then 0).
    opted = complete("4 " + body, mode="chunk_kv_reuse", recompute_strategy="none")
    assert kvboost_of(opted)["approximate"] is True and kvboost_of(opted)["approximate_tokens"] > 0
    streamed = list(client.completions.create(
        model=str(stack.model_dir), prompt="5 " + body, max_tokens=MAX_NEW_TOKENS, temperature=0, stream=True,
        extra_body={"cache_salt": salt, "kvboost": {"mode": "chunk_kv_reuse"}}))
    labelled = [chunk.model_extra["kvboost"] for chunk in streamed if chunk.model_extra.get("kvboost")]
    assert [label["approximate"] for label in labelled] == [True, True]
    assert streamed[0].model_extra.get("kvboost") == labelled[0]  # the first chunk already says it
