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


class BlockingStore(InMemoryStore):
    """Stores only once released: a daemon that stalls every write-back."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def store(self, items):
        assert self.release.wait(60), "the test never released the store"
        return super().store(items)


def test_write_backs_that_stall_hold_their_slots_so_the_queue_of_them_is_bounded(tiny_llama):
    """A flood against a stalled store: each ended request's write-back keeps its slot until it has encoded
    its K/V, so at most every slot's worth are pending and later requests wait; nothing is lost on release."""
    model, tokenizer = tiny_llama
    store = BlockingStore()
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, max_queue=64, max_running_requests=2), store, "tiny")
    num_slots = engine.core.owner.ledger.num_slots
    num_requests = num_slots + 10
    done: list = []
    try:
        for index in range(num_requests):  # each prompt holds two whole chunks: every request writes back
            engine.submit(GenerationParams(prompt=f"Request {index}: the harbour opens at seven and closes late.",
                                           max_new_tokens=2), None, lambda: False,
                          lambda result, error: done.append(error or result))
        wait_for(lambda: len(done) == num_slots and engine.stats()["waiting_requests"] == num_requests - num_slots,
                 what="every slot held by a pending write-back, the rest waiting")
        # Each held slot has at most two write-backs queued: its prompt's new chunks and its answer.
        assert len(engine.parts.writeback._pending) <= 2 * num_slots
        assert engine.stats()["running_rows"] == 0 and len(store) == 0
        store.release.set()
        wait_for(lambda: len(done) == num_requests, what="every request to finish once the store answers")
        engine.parts.writeback.flush(30)
    finally:
        store.release.set()
        engine.stop(30)
    assert all(isinstance(outcome, list) and outcome[0].generated_tokens == 2 for outcome in done)
    assert len(store) >= 2 * num_requests
