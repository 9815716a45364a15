"""The InferenceService over a real in-process grpc.aio server with the tiny Llama engine and an in-process cache."""
from __future__ import annotations

import asyncio
import math
import threading
import time
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_service.store.memory import InMemoryStore
from inference_service.serving.config import ServiceConfig
from inference_service.engine import request as request_module
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.serving.server import CACHE_HEALTH_NAME, SERVICE_NAME, build_server
from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc

CHUNK_SIZE = 8
MAX_NEW_TOKENS_LIMIT = 4096
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3  # 135 byte tokens: 16 full chunks and a tail
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=120))


@pytest.fixture()
def engine(tiny_llama):
    model, tokenizer = tiny_llama
    config = EngineConfig(chunk_size=CHUNK_SIZE, max_new_tokens_limit=MAX_NEW_TOKENS_LIMIT)
    engine = Engine(model, tokenizer, config, InMemoryStore(), model_id="tiny-llama")
    yield engine
    engine.close()


def make_config(**overrides) -> ServiceConfig:
    values = dict(listen="127.0.0.1:0", cache_addr="in-process", engine=EngineConfig(chunk_size=CHUNK_SIZE, max_queue=4))
    values.update(overrides)
    return ServiceConfig(**values)


@asynccontextmanager
async def serving(engine, metadata=(), **overrides):
    """(server, stub, health stub) on a free port; always stopped. max_queue: the engine's queue while serving."""
    max_queue = overrides.pop("max_queue", None)
    queue_before = engine.core.max_queue if engine is not None else None
    if max_queue is not None:
        engine.core.max_queue = max_queue
    server = build_server(make_config(**overrides), engine)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, inference_pb2_grpc.InferenceServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    finally:
        await server.stop(0)
        if engine is not None:
            engine.core.max_queue = queue_before


async def generate(stub, **fields) -> list[pb.GenerateEvent]:
    return [event async for event in stub.Generate(pb.GenerateRequest(**fields), timeout=60)]


async def health_status(health, service: str = "") -> int:
    return (await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def wait_until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def record_outcomes(engine, monkeypatch) -> list:
    """Wraps the sequences' record_outcome so the test sees each outcome the engine produced."""
    outcomes, original_record = [], request_module.record_outcome

    def recording_outcome(*args, **kwargs):
        outcomes.append(original_record(*args, **kwargs))
        return outcomes[-1]

    monkeypatch.setattr(request_module, "record_outcome", recording_outcome)
    return outcomes


# --- Generate ----------------------------------------------------------------------------------------

def test_generate_streams_tokens_then_a_final_result(engine) -> None:
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            return await generate(stub, prompt=PROMPT, max_new_tokens=12, request_id="req-7")

    events = run(scenario())
    *tokens, last = events
    result = last.result
    assert all(not event.HasField("result") for event in tokens)
    assert last.HasField("result")
    # The streamed pieces add up to the final text and ids.
    assert [i for event in events for i in event.token_ids] == list(result.output_token_ids)
    assert "".join(event.text for event in events) == result.output_text
    assert result.generated_tokens == len(result.output_token_ids) == 12
    assert result.finish_reason == "length"
    assert result.prompt_tokens == len(PROMPT)
    assert result.mode == pb.PREFIX_CACHE  # the server default: exact reuse
    assert not result.approximate and result.approximate_tokens == 0
    assert result.request_id == "req-7"
    assert result.ttft_ms > 0 and result.total_ms >= result.ttft_ms
    assert not result.degraded


def test_second_call_reuses_the_prefix_and_matches_baseline(engine) -> None:
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            baseline = (await generate(stub, prompt=PROMPT, max_new_tokens=8, mode=pb.BASELINE))[-1].result
            first = (await generate(stub, prompt=PROMPT, max_new_tokens=8, mode=pb.PREFIX_CACHE))[-1].result
            await asyncio.to_thread(engine.flush_writes, 10)
            second = (await generate(stub, prompt=PROMPT, max_new_tokens=8, mode=pb.PREFIX_CACHE))[-1].result
            return baseline, first, second

    baseline, first, second = run(scenario())
    assert (baseline.cached_tokens, first.cached_tokens) == (0, 0)
    assert second.cached_tokens == len(PROMPT) - 1  # whole chunks and the partial tail: all but the last token
    assert second.kv_reuse_ratio == pytest.approx(second.cached_tokens / len(PROMPT))
    assert second.mode == pb.PREFIX_CACHE
    assert second.output_token_ids == first.output_token_ids == baseline.output_token_ids


@pytest.mark.parametrize("fields, message", [
    (dict(), "exactly one of prompt, messages, segments"),
    (dict(prompt="hi", temperature=math.nan), "temperature must be finite"),
    (dict(prompt="hi", max_new_tokens=10 * MAX_NEW_TOKENS_LIMIT), "over the server's limit"),
    (dict(prompt="hi", top_p=1.5), "top_p must be in"),
    (dict(messages=[pb.ChatMessage(role="robot", content="hi")]), "message role"),
    (dict(prompt="x" * 5000), "at most 4096 are accepted"),
    (dict(prompt="hi", mode=9), "mode 9 is not one of BASELINE=1, PREFIX_CACHE=2, CHUNK_KV_REUSE=3"),
    (dict(prompt="hi", recompute_strategy=7), "recompute_strategy 7 is not one of NONE=1"),
])
def test_malformed_requests_are_invalid_argument(engine, fields, message) -> None:
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await generate(stub, **fields)
            return raised.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()


def test_a_full_queue_is_resource_exhausted_and_counted(engine) -> None:
    started, release, ended = threading.Event(), threading.Event(), threading.Event()

    def hold_the_model(event):  # a request whose stream callback holds the engine's step loop
        started.set()
        release.wait(30)

    async def scenario():
        async with serving(engine, max_queue=1) as (server, stub, _health):
            engine.submit(GenerationParams(prompt="held", max_new_tokens=1), hold_the_model, lambda: False,
                          lambda *_: ended.set())
            await asyncio.to_thread(started.wait, 10)
            queued = asyncio.create_task(generate(stub, prompt="queued", max_new_tokens=2))
            await wait_until(lambda: engine.core.num_waiting == 1, what="the queued request")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await generate(stub, prompt="refused", max_new_tokens=2)
            stats = await stub.Stats(pb.ServiceStatsRequest(), timeout=5)
            release.set()
            await asyncio.to_thread(ended.wait, 10)
            return raised.value, stats, (await queued)[-1].result

    error, stats, queued_result = run(scenario())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-queue" in error.details()
    assert (stats.rejected, stats.queue_depth) == (1, 1)
    assert queued_result.generated_tokens == 2


def test_client_cancellation_stops_generation(engine, monkeypatch) -> None:
    outcomes = record_outcomes(engine, monkeypatch)

    async def scenario():
        async with serving(engine) as (_, stub, _health):
            call = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS_LIMIT - len(PROMPT)))
            first = await call.read()
            call.cancel()
            await wait_until(lambda: outcomes, what="the engine to stop")
            return first

    first = run(scenario())
    assert first.token_ids
    assert outcomes[0].finish_reason == "cancelled"
    assert outcomes[0].generated_tokens < MAX_NEW_TOKENS_LIMIT - len(PROMPT)


def test_a_passed_deadline_stops_generation(engine, monkeypatch) -> None:
    outcomes = record_outcomes(engine, monkeypatch)

    async def scenario():
        async with serving(engine) as (_, stub, _health):
            request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS_LIMIT - len(PROMPT))
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in stub.Generate(request, timeout=0.3):
                    pass
            await wait_until(lambda: outcomes, what="the engine to stop")
            return raised.value

    assert run(scenario()).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert outcomes[0].finish_reason == "cancelled"


# --- the other RPCs ----------------------------------------------------------------------------------

def test_batch_and_many_return_results_in_input_order(engine) -> None:
    prompts = ["first prompt here", PROMPT, "a third one"]

    async def scenario():
        async with serving(engine) as (_, stub, _health):
            singles = [(await generate(stub, prompt=p, max_new_tokens=5, mode=pb.BASELINE))[-1].result for p in prompts]
            request = pb.GenerateBatchRequest(requests=[
                pb.GenerateRequest(prompt=p, max_new_tokens=5, mode=pb.BASELINE, request_id=f"r{i}") for i, p in enumerate(prompts)])
            batch = await stub.GenerateBatch(request, timeout=60)
            many = await stub.GenerateMany(request, timeout=60)
            return singles, batch, many

    singles, batch, many = run(scenario())
    for reply in (batch, many):
        assert [r.request_id for r in reply.results] == ["r0", "r1", "r2"]
        assert [r.prompt_tokens for r in reply.results] == [len(p) for p in prompts]
        assert [list(r.output_token_ids) for r in reply.results] == [list(r.output_token_ids) for r in singles]


def test_a_malformed_batch_request_is_named_by_its_index(engine) -> None:
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            request = pb.GenerateBatchRequest(requests=[pb.GenerateRequest(prompt="fine"), pb.GenerateRequest(prompt="")])
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.GenerateBatch(request, timeout=30)
            return raised.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("requests[1]: exactly one of prompt")


def test_warm_then_generate_hits_the_warmed_chunks(engine) -> None:
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            warmed = await stub.Warm(pb.WarmRequest(text=PROMPT), timeout=60)
            result = (await generate(stub, prompt=PROMPT + "Why?", max_new_tokens=3, mode=pb.PREFIX_CACHE))[-1].result
            return warmed, result

    warmed, result = run(scenario())
    assert (warmed.chunks_stored, warmed.token_count, warmed.chunk_size) == (16 + 1, 135, CHUNK_SIZE)  # + partial tail
    assert (warmed.chunk_boundary_aligned, warmed.partial_tail_tokens) == (False, 7)
    assert "7 tokens" in warmed.alignment_warning
    assert result.cached_tokens == 135  # the prompt continues the warmed text: all of it is reused


def test_warm_without_text_is_invalid_argument(engine) -> None:
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Warm(pb.WarmRequest(), timeout=10)
            return raised.value

    assert run(scenario()).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_verify_stats_and_model_info(engine) -> None:
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            report = await stub.VerifyCorrectness(pb.VerifyRequest(prompts=[PROMPT, "short"], max_new_tokens=4), timeout=60)
            stats = await stub.Stats(pb.ServiceStatsRequest(), timeout=5)
            info = await stub.ModelInfo(pb.ModelInfoRequest(), timeout=5)
            return report, stats, info

    report, stats, info = run(scenario())
    assert (report.identical, report.total) == (2, 2)
    assert [p.prompt for p in report.prompts] == [PROMPT, "short"]
    assert report.prompts[0].first_token_cosine == pytest.approx(1.0, abs=1e-5)
    assert report.prompts[0].cached_tokens == len(PROMPT) - 1
    # Verify ran BASELINE and the cached mode twice per prompt.
    assert stats.requests == 6
    assert (stats.cache_address, stats.degraded, stats.queue_depth, stats.rejected) == ("in-process", False, 0, 0)
    assert stats.mean_ttft_ms > 0
    assert (info.model, info.architecture, info.num_layers, info.num_kv_heads) == ("tiny-llama", "LlamaForCausalLM", 2, 2)
    assert (info.chunk_size, info.kv_cache_bits, info.dtype) == (CHUNK_SIZE, 16, "float32")
    assert info.default_recompute_strategy == pb.SELECTIVE
    assert len(info.namespace_hex) == 64


# --- health, loading, auth ---------------------------------------------------------------------------

def test_health_is_not_serving_until_the_engine_is_set(engine) -> None:
    async def scenario():
        async with serving(None) as (server, stub, health):
            before = await health_status(health), await health_status(health, SERVICE_NAME)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await generate(stub, prompt="hi", max_new_tokens=2)
            await server.set_engine(engine)
            after = await health_status(health), await health_status(health, SERVICE_NAME)
            result = (await generate(stub, prompt="hi", max_new_tokens=2))[-1].result
            return before, raised.value, after, result

    before, error, after, result = run(scenario())
    assert before == (NOT_SERVING, NOT_SERVING)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "loading" in error.details()
    assert after == (SERVING, SERVING)
    assert result.generated_tokens == 2


def test_health_mirrors_the_cache_degraded_flag(engine) -> None:
    async def scenario():
        async with serving(engine) as (_, stub, health):
            await wait_until_status(health, SERVING)
            engine.store.degraded = True
            await wait_until_status(health, NOT_SERVING)
            stats = await stub.Stats(pb.ServiceStatsRequest(), timeout=5)
            engine.store.degraded = False
            await wait_until_status(health, SERVING)
            return stats, await health_status(health)

    async def wait_until_status(health, status):
        deadline = time.monotonic() + 10
        while await health_status(health, CACHE_HEALTH_NAME) != status:
            assert time.monotonic() < deadline, f"cache health never became {status}"
            await asyncio.sleep(0.05)

    stats, overall = run(scenario())
    assert stats.degraded
    assert overall == SERVING  # degraded still serves: only the cache entry turns NOT_SERVING


def test_bearer_token_guards_every_rpc_but_health(engine, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")

    async def scenario():
        async with serving(engine, auth_token_file=str(token_file)) as (_, stub, health):
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.ModelInfo(pb.ModelInfoRequest(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await generate_with(stub, "Bearer nope")
            good = await stub.ModelInfo(pb.ModelInfoRequest(), timeout=5, metadata=(("authorization", "Bearer s3cret"),))
            events = await generate_with(stub, "Bearer s3cret")
            return missing.value, wrong.value, good, events, await health_status(health)

    async def generate_with(stub, authorization):
        call = stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=2), timeout=30,
                             metadata=(("authorization", authorization),))
        return [event async for event in call]

    missing, wrong, good, events, health = run(scenario())
    assert missing.code() == wrong.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer" in missing.details()
    assert good.chunk_size == CHUNK_SIZE
    assert events[-1].result.generated_tokens == 2
    assert health == SERVING


# --- continuous batching -----------------------------------------------------------------------------

def test_concurrent_streams_share_the_running_batch_and_match_generate_alone(engine, tiny_llama) -> None:
    from kvboost_keys.prompts import tokenize_prompt
    from tests.inference_service.engine.test_batch import reference_ids

    model, tokenizer = tiny_llama
    prompts = [PROMPT + f"Question {index}?" * (index + 1) for index in range(5)] + ["Other prompt."]
    steps_before = []

    async def scenario():
        async with serving(engine, max_queue=16) as (server, stub, _health):
            core = engine.core
            steps_before.append(core.num_steps)
            calls = [generate(stub, prompt=prompt, max_new_tokens=10 + index, mode=pb.PREFIX_CACHE)
                     for index, prompt in enumerate(prompts)]
            results = [events[-1].result for events in await asyncio.gather(*calls)]
            return results, core.num_steps - steps_before[0]

    results, num_steps = run(scenario())
    for index, (prompt, result) in enumerate(zip(prompts, results)):
        assert list(result.output_token_ids) == reference_ids(model, tokenize_prompt(tokenizer, prompt)[0], 10 + index)
    assert num_steps < sum(result.generated_tokens for result in results), "requests decoded together"




def test_stats_and_metrics_show_the_step_loops_state(engine) -> None:
    import urllib.request

    from tests.conftest import pick_free_port

    port = pick_free_port()

    async def scenario():
        async with serving(engine, metrics_port=port) as (_, stub, _health):
            await generate(stub, prompt=PROMPT, max_new_tokens=2)
            # the row leaves the running batch once its write-back has encoded it: just after the last event
            await wait_until(lambda: engine.stats().get("running_rows", 0) == 0, what="the row to leave")
            stats = await stub.Stats(pb.ServiceStatsRequest(), timeout=5)
            scraped = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
            return stats, scraped

    stats, scraped = run(scenario())
    budget = engine.core.owner.ledger.budget_bytes
    assert (stats.running_rows, stats.waiting_requests, stats.kv_budget_bytes) == (0, 0, budget)
    samples = dict(line.rsplit(" ", 1) for line in scraped.splitlines() if line and not line.startswith("#"))
    assert float(samples["kvboost_engine_kv_budget_bytes"]) == budget
    assert float(samples["kvboost_engine_running_rows"]) == 0 and "kvboost_engine_kv_bytes_in_use" in samples


def test_a_slow_prompt_plan_never_blocks_the_event_loop(engine, monkeypatch):
    """Generate's prompt is tokenized, templated and hashed (engine.submit) on a worker thread: while one request's
    plan takes 0.4 s, the event loop keeps running (other streams' tokens keep flowing)."""
    original = engine.submit
    threads = []

    def slow_submit(*args, **kwargs):
        threads.append(threading.current_thread())
        time.sleep(0.4)  # stands in for a very long prompt's tokenization and hashing
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "submit", slow_submit)

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        async with serving(engine) as (_, stub, _health):
            loop_thread = threading.current_thread()  # the server runs on this test's event loop
            task = asyncio.create_task(ticker())
            events = await generate(stub, prompt=PROMPT, max_new_tokens=2)
            task.cancel()
        assert events[-1].HasField("result")
        assert threads and all(thread is not loop_thread for thread in threads)
        assert ticks >= 10, f"the event loop stalled while the prompt was planned ({ticks} ticks in 0.4 s)"

    run(scenario())
