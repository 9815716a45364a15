"""The step loop's front: a bounded queue, requests that could never fit refused up front, a clean stop."""
from __future__ import annotations

import threading

import pytest

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.errors import EngineStopped, QueueFull
from inference_service.store.memory import InMemoryStore
from tests.conftest import wait_for


def test_a_full_queue_refuses_and_a_stopped_engine_takes_nothing(tiny_llama):
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, max_queue=1), InMemoryStore(), "tiny")
    release, started, ended = threading.Event(), threading.Event(), []

    def hold(event):  # the running request's stream callback holds the loop
        started.set()
        release.wait(30)

    engine.submit(GenerationParams(prompt="held", max_new_tokens=1), hold, lambda: False,
                  lambda result, error: ended.append(error or result))
    assert started.wait(30)
    engine.submit(GenerationParams(prompt="queued", max_new_tokens=1), None, lambda: False,
                  lambda result, error: ended.append(error or result))
    with pytest.raises(QueueFull, match="--max-queue"):
        engine.submit(GenerationParams(prompt="refused", max_new_tokens=1), None, lambda: False, lambda *_: None)
    stopping = threading.Thread(target=engine.stop, kwargs={"timeout_s": 30})
    stopping.start()  # the queued request fails at once; the running one is let finish
    wait_for(lambda: ended, what="the queued request to fail")
    release.set()
    stopping.join()
    assert isinstance(ended[0], EngineStopped) and "before this request started" in str(ended[0])
    assert isinstance(ended[1], list) and ended[1][0].generated_tokens == 1
    with pytest.raises(EngineStopped):
        engine.submit(GenerationParams(prompt="late", max_new_tokens=1), None, lambda: False, lambda *_: None)
