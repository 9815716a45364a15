"""The prompt's Lookup is asked on the submitting thread: a slow daemon answer for one request never stalls the step
loop for the others, and the answer is the same reuse as a Lookup on the loop."""
from __future__ import annotations

import threading

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.engine.request import EngineRequest
from inference_service.store.memory import InMemoryStore
from tests.conftest import wait_for

DOCUMENT = "The quick brown fox jumps over the lazy dog. " * 4
OTHER_DOCUMENT = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 3


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
        # The fast request's write-back ended while the slow one waited; it stored none of the slow prompt's chunks
        # (another first token, so no continuation either): the slow answer holds, the loop asks nothing.
        assert slow["outcome"].generated_tokens == 4
        assert "engine-step-loop" not in store.lookup_threads and engine.stats()["step_loop_lookups"] == 0
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


def asked_early(engine: Engine, prompt: str, max_new_tokens: int = 4) -> tuple[EngineRequest, dict]:
    """A request whose Lookup is asked now, on this thread, but not yet submitted; and where its outcome will land."""
    params = GenerationParams(prompt=prompt, max_new_tokens=max_new_tokens)
    mode, plan, num_tokens = engine.plan_request(params)
    landed: dict = {"done": threading.Event()}

    def on_done(result, error) -> None:
        landed.update(result=result, error=error)
        landed["done"].set()

    return EngineRequest(params, None, lambda: False, on_done, engine.parts, mode, plan, num_tokens).ask_early(), landed


def run_asked(engine: Engine, seq: EngineRequest, landed: dict):
    engine.core.submit([seq])
    assert landed["done"].wait(60), "the request never ended"
    assert landed["error"] is None, landed["error"]
    return landed["result"][0]


def test_an_unrelated_write_back_keeps_the_early_answer(tiny_llama):
    # Found by review (issue 57): any write-back that ended discarded an early answer that missed chunks, so under
    # concurrent load the next turn of a chat (a cached document, new last chunk) was looked up on the step loop.
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="tiny")
    try:
        engine.generate(GenerationParams(prompt=DOCUMENT + " Q1?", max_new_tokens=3))
        engine.flush_writes()
        follow_up, landed = asked_early(engine, DOCUMENT + " Q1? And then what happened?")
        assert follow_up.early_lookup.prefix_run < len(follow_up.prompt.prefix_keys)  # its new chunks are missing
        # Meanwhile another client's document is written back.
        engine.generate(GenerationParams(prompt=OTHER_DOCUMENT, max_new_tokens=3))
        engine.flush_writes()
        assert follow_up.current_lookup() is follow_up.early_lookup
        outcome = run_asked(engine, follow_up, landed)
        assert engine.stats()["step_loop_lookups"] == 0
        assert outcome.cached_tokens >= len(DOCUMENT + " Q1?")
        baseline = engine.generate(GenerationParams(prompt=follow_up.params.prompt, max_new_tokens=4, mode="baseline"))
        assert outcome.output_text == baseline.output_text
    finally:
        engine.stop()


def test_a_write_back_of_the_prompts_own_missing_chunk_discards_the_early_answer(tiny_llama):
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="tiny")
    try:
        second, landed = asked_early(engine, DOCUMENT + " Q2?")
        assert second.early_lookup.prefix_run == 0
        # Another question on the same document stores the document's chunks: the answer above missed them.
        engine.generate(GenerationParams(prompt=DOCUMENT + " Q1?", max_new_tokens=3))
        engine.flush_writes()
        assert second.current_lookup() is None
        outcome = run_asked(engine, second, landed)
        assert engine.stats()["step_loop_lookups"] == 1
        assert outcome.cached_tokens >= len(DOCUMENT) // 8 * 8
    finally:
        engine.stop()


def test_eight_concurrent_clients_on_unrelated_documents_ask_no_lookup_on_the_step_loop(tiny_llama):
    # Each client asks about its own document, then asks a follow-up once its first turn is stored (a request whose
    # own chunks are still being written back waits for them and asks again: that is its own document, not load).
    model, tokenizer = tiny_llama
    store = GatedStore()
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, max_running_requests=8), store, model_id="tiny")
    documents = [f"{letter}{letter.lower()} document number {index}: " + "words of its own, " * (3 + index)
                 for index, letter in enumerate("ABCDEFGH")]
    start = threading.Barrier(len(documents))
    outcomes: dict = {}

    def client(index: int, document: str) -> None:
        start.wait(30)
        first = GenerationParams(prompt=document + " Why?", max_new_tokens=6)
        outcomes[index, 0] = engine.generate(first)
        tail_key = engine.plan_request(first)[1].tail_key
        wait_for(lambda: store.lookup(engine.parts.namespace, [], partial_keys=[tail_key]).partial_index == 0,
                 "the client's first turn stored")
        outcomes[index, 1] = engine.generate(GenerationParams(prompt=document + " Why? Tell me more.",
                                                              max_new_tokens=6))

    threads = [threading.Thread(target=client, args=item, name=f"client-{item[0]}") for item in enumerate(documents)]
    store.release.set()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(outcomes) == 2 * len(documents)
        assert engine.stats()["step_loop_lookups"] == 0
        assert "engine-step-loop" not in store.lookup_threads
        for index, document in enumerate(documents):  # every follow-up reused its whole first turn
            assert outcomes[index, 1].cached_tokens >= len(document + " Why?")
    finally:
        engine.stop()
