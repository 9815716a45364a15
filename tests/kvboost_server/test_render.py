"""vLLM's render endpoints and /tokenize on the gateway over a real engine, in process: the ids are the ones the
engine prefills for the same request (and the tokenizer's own), with the tokenization cache cold and warm."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from http_gateway.app import build_app
from http_gateway.config import GatewayConfig
from inference_service.engine.engine import GenerationParams
from inference_service.serving.config import ServiceConfig
from inference_service.serving.server import build_server
from kvboost_server.in_process import InProcessUpstream
from tests.inference_service.engine.test_engine import make_engine

# Long enough (>= 256 characters between special tokens) for the tokenization cache to keep its ids.
DOCUMENT = "The harbour handbook, chapter one: mooring lines, tides and the pilot's duties. " * 5
MESSAGES = [{"role": "system", "content": "Answer from the handbook."}, {"role": "user", "content": DOCUMENT}]


def post_all(engine, calls: list[tuple[str, dict]]) -> list[httpx.Response]:
    """POSTs each (path, body) in order to a gateway whose upstream is the engine's servicer, in process."""
    async def go() -> list[httpx.Response]:
        server = build_server(ServiceConfig(listen="127.0.0.1:0"), engine)
        app = build_app(GatewayConfig())
        app.state.gateway.upstream = InProcessUpstream(server.servicer, server.health, 60.0)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return [await client.post(path, json=body) for path, body in calls]

    return asyncio.run(go())


def engine_ids(engine, **fields) -> list[int]:
    """The ids the engine plans to prefill for the request."""
    return list(engine.plan_request(GenerationParams(**fields))[1].token_ids)


@pytest.fixture
def engine(tiny_llama):
    engine = make_engine(tiny_llama)
    yield engine
    engine.close()


def test_render_ids_are_the_engines_cold_and_warm(engine, tiny_llama):
    tokenizer = tiny_llama[1]
    chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    text_ids = tokenizer(DOCUMENT)["input_ids"]
    calls = [("/v1/chat/completions/render", {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}),
             ("/v1/completions/render", {"model": "tiny", "prompt": DOCUMENT, "max_tokens": 4})]
    cold = post_all(engine, calls)
    assert engine.stats()["tokenizer_cache_hits"] == 0
    engine.generate(GenerationParams(messages=tuple((m["role"], m["content"]) for m in MESSAGES), max_new_tokens=1))
    engine.generate(GenerationParams(prompt=DOCUMENT, max_new_tokens=1))
    warm = post_all(engine, calls)
    assert engine.stats()["tokenizer_cache_hits"] > 0  # the warm renders read the cache
    for responses in (cold, warm):
        assert [response.status_code for response in responses] == [200, 200]
        chat, text = (response.json()["token_ids"] for response in responses)
        assert chat == list(chat_ids) == engine_ids(engine, messages=tuple((m["role"], m["content"])
                                                                           for m in MESSAGES))
        assert text == list(text_ids) == engine_ids(engine, prompt=DOCUMENT)


def test_render_refuses_what_it_cannot_express(engine):
    segments, continued, tokenize_continued, tokenize_plain = post_all(engine, [
        ("/v1/completions/render", {"model": "tiny", "prompt": "", "kvboost": {"segments": ["a", "b"]}}),
        ("/v1/chat/completions/render", {"messages": MESSAGES, "continue_final_message": True}),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": False}),  # vllm-router's fallback body
    ])
    assert segments.status_code == 400 and "segments" in segments.json()["error"]["message"]
    assert continued.status_code == 400 and "continue_final_message" in continued.json()["error"]["message"]
    assert tokenize_continued.status_code == 400
    assert "continue_final_message is not supported" in tokenize_continued.json()["error"]["message"]
    assert tokenize_plain.status_code == 200
    assert tokenize_plain.json()["tokens"] == engine_ids(engine, messages=tuple((m["role"], m["content"])
                                                                                 for m in MESSAGES))
