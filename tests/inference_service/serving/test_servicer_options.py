"""The contract's gateway fields over a real in-process grpc.aio server: n, logprobs, prompt logprobs,
cache_salt, Tokenize and Detokenize."""
from __future__ import annotations


import grpc
import pytest

from inference_service.engine.engine import Engine, EngineConfig
from inference_service.store.memory import InMemoryStore
from kvboost.v1 import inference_pb2 as pb
from tests.inference_service.serving.test_servicer import generate, run, serving

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
# 90 byte tokens: 11 chunks of 8 and a stored 2-token partial tail, so a repeat reuses every token but the last
# (always recomputed for its logits).


@pytest.fixture()
def engine(tiny_llama):
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="tiny-llama")
    yield engine
    engine.close()


def test_n_choices_stream_with_their_index_and_end_with_one_result_each(engine):
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            return await generate(stub, prompt=PROMPT, max_new_tokens=5, n=3, logprobs=True, top_logprobs=2,
                                  mode=pb.BASELINE)

    events = run(scenario())
    results = [event.result for event in events if event.HasField("result")]
    assert [result.index for result in results] == [0, 1, 2]
    assert events[-3:] == [event for event in events if event.HasField("result")]  # results come last
    for result in results:
        mine = [event for event in events if event.index == result.index and not event.HasField("result")]
        assert [t for event in mine for t in event.token_ids] == list(result.output_token_ids)
        logprobs = [item for event in mine for item in event.logprobs]
        assert [item.token_id for item in logprobs] == list(result.output_token_ids)
        assert all(len(item.top) == 2 and item.HasField("logprob") for item in logprobs)


def test_prompt_logprobs_come_first_and_the_first_token_has_none(engine):
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            return await generate(stub, prompt=PROMPT, max_new_tokens=2, prompt_logprobs=0)

    events = run(scenario())
    scored = events[0].prompt_logprobs
    assert len(scored) == len(PROMPT) and not scored[0].HasField("logprob")
    assert all(item.HasField("logprob") and item.logprob <= 0 for item in scored[1:])


def test_cache_salt_reaches_the_engine(engine):
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            await stub.Warm(pb.WarmRequest(text=PROMPT, cache_salt="a"), timeout=30)
            salted = (await generate(stub, prompt=PROMPT, max_new_tokens=1, mode=pb.PREFIX_CACHE, cache_salt="a"))
            plain = (await generate(stub, prompt=PROMPT, max_new_tokens=1, mode=pb.PREFIX_CACHE))
            return salted[-1].result, plain[-1].result

    salted, plain = run(scenario())
    assert salted.cached_tokens == len(PROMPT) - 1 and plain.cached_tokens == 0


def test_tokenize_and_detokenize(engine):
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            counted = await stub.Tokenize(pb.TokenizeRequest(prompt="Hi!"), timeout=10)
            chat = await stub.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="Hi")]),
                                       timeout=10)
            text = await stub.Detokenize(pb.DetokenizeRequest(token_ids=counted.token_ids), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as empty:
                await stub.Tokenize(pb.TokenizeRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as outside:
                await stub.Detokenize(pb.DetokenizeRequest(token_ids=[10 ** 6]), timeout=10)
            return counted, chat, text, empty.value, outside.value

    counted, chat, text, empty, outside = run(scenario())
    assert list(counted.tokens) == ["H", "i", "!"] and len(counted.token_ids) == 3
    assert counted.max_context == 4096
    assert len(chat.token_ids) > 3
    assert text.text == "Hi!"
    assert empty.code() == outside.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_batches_refuse_fields_only_generate_takes(engine):
    async def scenario():
        async with serving(engine) as (_, stub, _health):
            request = pb.GenerateBatchRequest(requests=[pb.GenerateRequest(prompt="a", n=2),
                                                        pb.GenerateRequest(prompt="b")])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GenerateBatch(request, timeout=30)
            return refused.value

    refused = run(scenario())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "n" in refused.details()
