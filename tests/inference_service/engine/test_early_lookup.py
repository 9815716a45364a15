"""The prompt's Lookup is asked on the submitting thread: a slow daemon answer for one request never stalls the step
loop for the others, and the answer is the same reuse as a Lookup on the loop."""
from __future__ import annotations

import threading

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.store.memory import InMemoryStore
from tests.conftest import wait_for

DOCUMENT = "The quick brown fox jumps over the lazy dog. " * 4


class GatedStore(InMemoryStore):
    """Lookups of prompts that start with `gated` wait for `release` (a daemon slow to answer that request)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.waiting = threading.Event()
        self.gated_keys: set[bytes] = set()
        self.lookup_threads: list[str] = []

    def lookup(self, namespace, prefix_keys, content_keys=None, partial_keys=None, continuation=None, after_run=None):
        self.lookup_threads.append(threading.current_thread().name)
        if prefix_keys and prefix_keys[0] in self.gated_keys:
            self.waiting.set()
            assert self.release.wait(30), "the test never released the gated Lookup"
        return super().lookup(namespace, prefix_keys, content_keys, partial_keys, continuation, after_run)


def test_a_slow_lookup_does_not_stall_the_other_requests(tiny_llama):
    model, tokenizer = tiny_llama
    store = GatedStore()
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), store, model_id="tiny")
    try:
        slow_prompt = "Z" * 40 + DOCUMENT
        store.gated_keys.add(engine.plan_request(GenerationParams(prompt=slow_prompt))[1].prefix_keys[0])
        slow: dict = {}
        asker = threading.Thread(target=lambda: slow.update(
            outcome=engine.generate(GenerationParams(prompt=slow_prompt, max_new_tokens=4))), name="slow-request")
        asker.start()
        assert store.waiting.wait(10), "the slow request's Lookup was never asked"
        # While that Lookup hangs, another request runs through the step loop to its end.
        fast = engine.generate(GenerationParams(prompt=DOCUMENT, max_new_tokens=12))
        assert fast.generated_tokens == 12 and asker.is_alive()
        # So far every Lookup was asked by the requests' own threads, none by the step loop's.
        assert set(store.lookup_threads) <= {"slow-request", threading.current_thread().name}
        store.release.set()
        asker.join(30)
        # (The fast request's write-back ended while the slow one waited: its start asks again, on the loop.)
        assert slow["outcome"].generated_tokens == 4
    finally:
        store.release.set()
        engine.stop()


def test_an_early_answer_a_write_back_overtook_is_asked_again(tiny_llama):
    # Found by review: with one request running at a time, B is asked early (nothing cached yet), then waits while A
    # runs and writes back the shared document; B must reuse it, not trust its out-of-date answer.
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, l0_bytes=0, max_running_requests=1),
                    InMemoryStore(), model_id="tiny")
    gate = threading.Event()
    step = engine.core.step
    engine.core.step = lambda: (gate.wait(), step())  # both requests are asked before the loop's next step
    out: dict = {}
    threads = [threading.Thread(target=lambda name=name, prompt=prompt, tokens=tokens: out.update(
        {name: engine.generate(GenerationParams(prompt=prompt, max_new_tokens=tokens))}))
        for name, prompt, tokens in (("a", DOCUMENT + " Q1?", 30), ("b", DOCUMENT + " Q2?", 3))]
    try:
        for count, thread in enumerate(threads, start=1):
            thread.start()
            wait_for(lambda count=count: engine.core.num_waiting >= count, f"request {count} queued")
        gate.set()
        for thread in threads:
            thread.join(60)
        assert out["a"].cached_tokens == 0 and out["b"].cached_tokens >= len(DOCUMENT) // 8 * 8
    finally:
        gate.set()
        engine.stop()


def test_the_early_lookup_reuses_what_the_loop_would(tiny_llama):
    model, tokenizer = tiny_llama
    store = InMemoryStore()
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, l0_bytes=0), store, model_id="tiny")
    try:
        first = engine.generate(GenerationParams(prompt=DOCUMENT + " Q1?", max_new_tokens=3))
        engine.flush_writes()
        wait_for(lambda: len(store) > 0, "the write-back")
        second = engine.generate(GenerationParams(prompt=DOCUMENT + " Q1? And Q2?", max_new_tokens=3))
        # The whole first prompt (its chunks and its tail as a partial chunk) and its answer's tokens.
        assert second.cached_tokens >= first.prompt_tokens
    finally:
        engine.stop()
