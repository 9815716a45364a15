"""Qwen2.5-Coder-0.5B-Instruct (the catalogue's verified GGUF, fp32): exact reuse stays token-identical to plain
transformers model.generate in-process, in the engine's running batch, over gRPC and through the gateway.
Its chat template adds a default system prompt, it has q/k/v biases, 2 K/V heads, rope theta 1e6 and a 151k
vocabulary. `make test` prepares the model first (make model MODEL=qwen2.5-coder-0.5b)."""
from __future__ import annotations

import grpc
import openai
import pytest
import torch

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from kvboost_keys.prompts import tokenize_messages, tokenize_prompt
from inference_service.model import weights
from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions
from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from kvboost_common import catalogue
from tests.conftest import pick_free_port, wait_for
from tests.e2e.daemon_process import start_daemon
from tests.e2e.gateway_process import running_gateways
from tests.e2e.service_process import running_service

MODEL = catalogue.QWEN_CODER_05B.name
pytestmark = [
    pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600),
    pytest.mark.skipif(weights.read_marker(weights.converted_dir(catalogue.QWEN_CODER_05B)) is None,
                       reason=f"{MODEL} is not prepared: `make model MODEL={MODEL}` (make test does it)"),
]

MAX_NEW_TOKENS = 10
CODE = '''def parse_header(line: str) -> tuple[str, str]:
    """Splits an HTTP header line into its name and value."""
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def parse_headers(lines: list[str]) -> dict[str, str]:
    headers = {}
    for line in lines:
        if not line.strip():
            break
        name, value = parse_header(line)
        headers[name] = value
    return headers
'''
QUESTIONS = ("What does parse_header return?", "Write a docstring for parse_headers.", "Is the name lower-cased?")


def cases() -> list[dict]:
    chats = [{"messages": (("user", f"{CODE}\n{question}"),)} for question in QUESTIONS]
    chats.append({"messages": (("system", "You review Python code."), ("user", f"{CODE}\n{QUESTIONS[0]}"))})
    return chats + [{"prompt": CODE + "\n# Tests\ndef test_parse_header():\n"}]


@pytest.fixture(scope="module")
def qwen():
    from inference_service.model.loading import load_model

    loaded = load_model(MODEL, device="cpu", dtype="float32")
    assert loaded.weights_id == f"gguf-sha256:{catalogue.QWEN_CODER_05B.sha256}"
    assert catalogue.guard_threshold_for(loaded.weights_id)[1] == "tuned for qwen2.5-coder-0.5b"
    return loaded


@pytest.fixture(scope="module")
def references(qwen):
    rows = []
    for case in cases():
        ids = (tokenize_messages(qwen.tokenizer, case["messages"]) if "messages" in case
               else tokenize_prompt(qwen.tokenizer, case["prompt"]))[0]
        input_ids = torch.tensor([ids])
        with torch.inference_mode():  # transformers' default attention: the ground truth
            output = qwen.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                         max_new_tokens=MAX_NEW_TOKENS)
        rows.append((case, ids, output[0, len(ids):].tolist()))
    return rows


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    process = start_daemon(tmp_path_factory.mktemp("qwen") / "lmdb", pick_free_port(), "--max-bytes", "4GB")
    try:
        yield process
    finally:
        process.terminate()


def test_the_default_system_prompt_is_in_the_template(qwen, references):
    text = qwen.tokenizer.decode(references[0][1])
    assert text.startswith("<|im_start|>system\n") and "Qwen" in text.split("<|im_end|>")[0]


def test_prefix_hits_in_process_and_in_the_running_batch(qwen, references, daemon):
    store = GrpcChunkStore(GrpcStoreOptions(address=daemon.address))
    engine = Engine(qwen.model, qwen.tokenizer, EngineConfig(chunk_size=64), store, model_id=MODEL)
    try:
        for case, ids, expected in references:
            outcomes = []
            for _ in range(2):  # the first call computes and writes back, the second reuses
                outcomes.append(engine.generate(GenerationParams(**case, max_new_tokens=MAX_NEW_TOKENS,
                                                                 mode="prefix_cache")))
                engine.flush_writes()
            assert [outcome.output_token_ids for outcome in outcomes] == [expected, expected], case
            assert outcomes[1].cached_tokens == len(ids) - 1
        results: dict[int, object] = {}
        for index, (case, _, _) in enumerate(references):  # all at once: they share decode steps
            engine.submit(GenerationParams(**case, max_new_tokens=MAX_NEW_TOKENS, mode="prefix_cache"), None,
                          lambda: False, lambda outcomes, error, index=index: results.__setitem__(index, error or outcomes[0]))
        wait_for(lambda: len(results) == len(references), timeout_s=300, what="the batched cases")
        assert [results[index].output_token_ids for index in range(len(references))] == \
            [expected for _, _, expected in references]
    finally:
        engine.close()
        store.close()


def test_grpc_and_gateway(tmp_path, qwen, references, daemon):
    with running_service(MODEL, daemon.address, pick_free_port(), tmp_path / "service.log", "--chunk-size", "64",
                         timeout_s=240) as service, \
            running_gateways((service.address, pick_free_port(), tmp_path / "gateway.log")) as (gateway,), \
            grpc.insecure_channel(service.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=240)
        for case, ids, expected in references[:2]:
            messages = [pb.ChatMessage(role=role, content=content) for role, content in case["messages"]]
            result = list(stub.Generate(pb.GenerateRequest(messages=messages, max_new_tokens=MAX_NEW_TOKENS,
                                                           mode=pb.PREFIX_CACHE), timeout=240))[-1].result
            assert list(result.output_token_ids) == expected
            reply = client.chat.completions.create(
                model=client.models.list().data[0].id, max_tokens=MAX_NEW_TOKENS, temperature=0,
                messages=[{"role": role, "content": content} for role, content in case["messages"]])
            assert reply.choices[0].message.content == qwen.tokenizer.decode(expected, skip_special_tokens=True)
            assert reply.usage.prompt_tokens == len(ids)
            # Written back by the gRPC call (or the one before): whole chunks of this prompt come from the cache.
            assert reply.usage.prompt_tokens_details.cached_tokens >= 64
