"""The engine and the service on CUDA (`pytest -m gpu`; skipped, saying so, where no GPU is present).

Ground truth is plain transformers' `model.generate` on the same CUDA model at the same dtype, with its default
attention; the cache is a real daemon process read as the service reads it on its own host (the locked map)."""
from __future__ import annotations

import copy
import os
from contextlib import ExitStack

import grpc
import pytest
import torch

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.errors import InvalidRequest
from inference_service.serving.config import ServiceConfig
from inference_service.store.colocated import ColocatedStore
from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions
from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from kvboost_keys.prompts import tokenize_prompt
from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.factories import build_tiny_model
from tests.service_support import serving_in_thread

pytestmark = pytest.mark.gpu
# KVBOOST_TEST_DEVICE=cpu runs this file's logic on the CPU (a dry run where no GPU is present; see tests/conftest.py).
DEVICE = os.environ.get("KVBOOST_TEST_DEVICE", "cuda")

CHUNK = 16
NEW_TOKENS = 24
LENGTHS = (5, 37, 160, 333)  # shorter than a chunk, a chunk and a tail, many chunks, many and a tail


def text_of_length(num_tokens: int, salt: int = 0) -> str:
    base = f"Pump {salt} is checked weekly; the valves are exercised monthly. "
    return (base * (num_tokens // len(base) + 1))[:num_tokens]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def cuda_model(request):
    model, tokenizer = build_tiny_model(request.param)
    return copy.deepcopy(model).to(DEVICE), tokenizer


def reference_ids(model, token_ids: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    input_ids = torch.tensor([token_ids], device=model.device)
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens)
    return output[0, len(token_ids):].tolist()


@pytest.fixture()
def daemon_store(tmp_path):
    with ExitStack() as stack:
        daemon = start_daemon(tmp_path / "lmdb", pick_free_port(), "--max-bytes", "1GB")
        stack.callback(daemon.terminate)
        remote = GrpcChunkStore(GrpcStoreOptions(address=daemon.address))
        store = ColocatedStore(remote, "on")
        stack.callback(store.close)
        store.check()
        yield store


def ask(engine: Engine, prompt: str, **fields):
    outcome = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=NEW_TOKENS, **fields))
    engine.flush_writes()
    return outcome


def test_misses_hits_and_l0_on_cuda_are_model_generate(cuda_model, daemon_store):
    model, tokenizer = cuda_model
    from_daemon = Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK, l0_bytes=0), daemon_store,
                         model_id="tiny")
    from_l0 = Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK, l0_bytes=64 << 20), daemon_store,
                     model_id="tiny")
    try:
        assert from_daemon.device.type == DEVICE
        assert daemon_store.read_mode == "locked_map"
        for length in LENGTHS:
            prompt = text_of_length(length, salt=length)
            expected = reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])
            miss = ask(from_daemon, prompt)
            hit = ask(from_daemon, prompt)
            assert miss.output_token_ids == expected, f"{length} tokens, nothing cached"
            assert hit.output_token_ids == expected, f"{length} tokens, from the daemon"
            assert hit.cached_tokens >= min((length // CHUNK) * CHUNK, length - 1)
            assert ask(from_l0, prompt).output_token_ids == expected, f"{length} tokens, fetched into L0"
            assert ask(from_l0, prompt).output_token_ids == expected, f"{length} tokens, from L0"
        stats = from_l0.stats()
        assert stats["l0_chunks_hit"] > 0, stats
        assert from_daemon.stats()["load_bytes"] > 0
    finally:
        from_daemon.close()
        from_l0.close()


def test_l0_lives_on_the_device_is_shared_and_evicts_within_its_bytes(cuda_model, daemon_store):
    model, tokenizer = cuda_model
    per_chunk = 2 * 2 * 2 * CHUNK * 16 * 4  # K and V x layers x kv heads x tokens x head_dim x fp32
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK, l0_bytes=12 * per_chunk), daemon_store,
                    model_id="tiny")
    try:
        shared = text_of_length(8 * CHUNK, salt=1)
        ask(engine, shared)
        l0 = engine.parts.l0
        assert all(entry[0].device.type == DEVICE for entry in l0._kv.values())
        before = engine.stats()["l0_chunks_hit"]
        expected = reference_ids(model, tokenize_prompt(tokenizer, shared + " and more")[0])
        assert ask(engine, shared + " and more").output_token_ids == expected
        assert engine.stats()["l0_chunks_hit"] - before == 8, "a request with the same prefix is placed from L0"
        ask(engine, text_of_length(10 * CHUNK, salt=2))  # 18 chunks' worth through a 12-chunk tier
        assert l0.bytes_held <= 12 * per_chunk and l0.stats.chunks_evicted > 0
    finally:
        engine.close()


def test_slots_are_sized_by_the_budget_on_cuda(cuda_model):
    from inference_service.store.memory import InMemoryStore

    model, tokenizer = cuda_model
    per_token = 2 * 2 * 2 * 16 * 4
    budget = 1000 * per_token  # less than one slot of the model's 4096-token context
    allocated = torch.cuda.memory_allocated if DEVICE == "cuda" else lambda: 0
    before = allocated()
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK, kv_cache_bytes=budget, l0_bytes=0,
                                                   kv_slots_by_budget=None if DEVICE == "cuda" else True),
                    InMemoryStore(), model_id="tiny")
    try:
        assert engine.core.layout.by_budget, "CUDA commits memory at allocation: slots by budget"
        buffers = engine.core.owner.buffers
        assert 2 * buffers.keys.numel() * buffers.keys.element_size() <= budget
        # Beside the slots (checked above): the graph probe and pool, and cuBLAS workspaces of the capture streams
        assert allocated() - before <= budget + (256 << 20)  # measured on an H200: ~100 MB
        capacity = engine.core.layout.capacity
        assert capacity < 1000
        with pytest.raises(InvalidRequest):
            engine.generate(GenerationParams(prompt=text_of_length(capacity + 10), max_new_tokens=4))
        prompt = text_of_length(100)
        assert ask(engine, prompt).output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])
    finally:
        engine.close()


def test_the_service_on_cuda_answers_over_grpc_as_model_generate(cuda_model, daemon_store):
    model, tokenizer = cuda_model
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK), daemon_store, model_id="tiny")
    config = ServiceConfig(listen="127.0.0.1:0", cache_addr=daemon_store.address, device=DEVICE,
                           engine=engine.config)
    prompt = text_of_length(200, salt=7)
    expected = reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])
    try:
        with serving_in_thread(config, engine) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            for _ in range(3):  # a miss, a hit from L0 or the daemon, again
                events = list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=NEW_TOKENS), timeout=60))
                assert list(events[-1].result.output_token_ids) == expected
                engine.flush_writes()
            assert events[-1].result.cached_tokens > 0
    finally:
        engine.close()


def test_bf16_warmed_answers_match_baseline(cuda_model, daemon_store):
    """What the cache promises on the GPU at serving precision: the warmed path answers as BASELINE does. Also
    reported: agreement with model.generate in bf16 (attention kernels may round differently there)."""
    model, tokenizer = cuda_model
    model = copy.deepcopy(model).to(torch.bfloat16)
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK), daemon_store, model_id="tiny-bf16")
    try:
        agree = 0
        for length in LENGTHS:
            prompt = text_of_length(length, salt=3 * length)
            baseline = ask(engine, prompt, mode="baseline").output_token_ids
            ask(engine, prompt)
            warmed = ask(engine, prompt)
            assert warmed.output_token_ids == baseline, f"{length} tokens: warmed differs from BASELINE in bf16"
            agree += baseline == reference_ids(model, tokenize_prompt(tokenizer, prompt)[0])
        print(f"\nbf16: {agree}/{len(LENGTHS)} answers identical to model.generate")
    finally:
        engine.close()
