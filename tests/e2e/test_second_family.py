"""The tiny random Qwen2 (q/k/v biases, 2 K/V heads, rope theta 1e6) on every process path: the service over
gRPC with co-located LMDB reads and with Fetch over the wire, a batch call, and the HTTP gateway through the
openai SDK. Each greedy answer, first computed then reused, equals plain transformers' model.generate."""
from __future__ import annotations

import grpc
import openai
import pytest

from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.e2e.gateway_process import running_gateways
from tests.e2e.service_process import running_service
from tests.e2e.stack_process import reference_ids, save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHUNK_SIZE = 8
MAX_NEW_TOKENS = 12
DOCUMENT = "Qwen2 keeps biases on q, k and v; its rotary base is one million. " * 3
QUESTIONS = ("Which base?", "Which biases are kept?", "How many heads?")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2") / "model", kind="qwen2")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "qwen2" and config.num_key_value_heads == 2
    assert config.rope_parameters["rope_theta"] == 1e6
    return folder


@pytest.mark.parametrize("local_read", ["auto", "off"])
def test_grpc_paths_reuse_and_stay_identical(tmp_path, qwen2_dir, local_read):
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port())
    try:
        with running_service(str(qwen2_dir), daemon.address, pick_free_port(), tmp_path / "service.log",
                             "--chunk-size", str(CHUNK_SIZE), "--cache-local-read", local_read) as service, \
                grpc.insecure_channel(service.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            for question in QUESTIONS:
                prompt = DOCUMENT + question
                expected = reference_ids(qwen2_dir, prompt, MAX_NEW_TOKENS)
                results = []
                for _ in range(2):
                    events = list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS,
                                                                   mode=pb.PREFIX_CACHE), timeout=60))
                    results.append(events[-1].result)
                    stub.Stats(pb.ServiceStatsRequest(), timeout=10)
                assert [list(result.output_token_ids) for result in results] == [expected, expected], question
            # The document's chunks are stored by now: a batch call of all three questions reuses them.
            batch = stub.GenerateBatch(pb.GenerateBatchRequest(requests=[
                pb.GenerateRequest(prompt=DOCUMENT + question, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
                for question in QUESTIONS]), timeout=120)
            for question, result in zip(QUESTIONS, batch.results):
                assert list(result.output_token_ids) == reference_ids(qwen2_dir, DOCUMENT + question, MAX_NEW_TOKENS)
                assert result.cached_tokens >= len(DOCUMENT) // CHUNK_SIZE * CHUNK_SIZE - CHUNK_SIZE
    finally:
        daemon.terminate()


def test_the_gateway_serves_the_second_family_identically(tmp_path, qwen2_dir):
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port())
    try:
        with running_service(str(qwen2_dir), daemon.address, pick_free_port(), tmp_path / "service.log",
                             "--chunk-size", str(CHUNK_SIZE)) as service, \
                running_gateways((service.address, pick_free_port(), tmp_path / "gateway.log")) as (gateway,):
            client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
            model = client.models.list().data[0].id
            prompt = DOCUMENT + QUESTIONS[0]
            expected = reference_ids(qwen2_dir, prompt, MAX_NEW_TOKENS)
            cached = []
            for stream in (False, True, False):
                if stream:
                    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW_TOKENS,
                                                            temperature=0, stream=True, logprobs=0))
                    tokens = [token for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                              for token in chunk.choices[0].logprobs.tokens]
                    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
                else:
                    reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW_TOKENS,
                                                      temperature=0)
                    text, tokens = reply.choices[0].text, None
                    cached.append(reply.usage.prompt_tokens_details.cached_tokens
                                  if reply.usage.prompt_tokens_details else 0)
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
                assert text == tokenizer.decode(expected, skip_special_tokens=True), stream
                if tokens is not None:
                    assert len(tokens) == len(expected)
            assert cached[-1] > 0, "the last call reuses what the first ones stored"
    finally:
        daemon.terminate()
