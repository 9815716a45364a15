"""A request whose prompt chunks this process is still writing back waits for them (bounded) instead of
recomputing them; BASELINE never waits; nothing waits past the hold. Without L0: with it, the chunks being written
back are placed from L0 at once (tests/inference_service/engine/test_l0.py)."""
from __future__ import annotations

import threading
import time

from inference_service.engine import core as core_module
from inference_service.engine.engine import GenerationParams
from kvboost_keys.prompts import tokenize_prompt
from inference_service.store.memory import InMemoryStore
from tests.inference_service.engine.test_engine import make_engine, reference_ids, text_of_length

DOCUMENT = text_of_length(64)


class GatedStore(InMemoryStore):
    """Stores only once the gate opens, like a slow write-back of a long prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def store(self, items):
        self.gate.wait(timeout=30)
        return super().store(items)


def submit(engine, prompt: str, mode: str = "prefix_cache") -> dict:
    result: dict = {}
    done = threading.Event()

    def finished(outcomes, error):
        result["outcome"], result["error"] = (outcomes[0] if outcomes else None), error
        done.set()

    engine.submit(GenerationParams(prompt=prompt, max_new_tokens=4, mode=mode), None, lambda: False, finished)
    result["done"] = done
    return result


def test_a_follow_up_waits_for_the_write_back_it_needs(tiny_llama):
    model, tokenizer = tiny_llama
    store = GatedStore()
    engine = make_engine(tiny_llama, chunk_size=8, cache=store, l0_bytes=0)  # with L0 nothing waits (test_l0)
    try:
        first = submit(engine, DOCUMENT + " first?")
        assert first["done"].wait(30) and first["error"] is None  # answered; its write-back waits on the gate
        follow_up = submit(engine, DOCUMENT + " second?")
        baseline = submit(engine, DOCUMENT + " third?", mode="baseline")
        assert baseline["done"].wait(30), "BASELINE needs nothing stored: it never waits"
        assert not follow_up["done"].wait(0.3), "held while its chunks are being written back"
        store.gate.set()
        assert follow_up["done"].wait(30) and follow_up["error"] is None
        outcome = follow_up["outcome"]
        assert outcome.cached_tokens >= 64
        prompt = DOCUMENT + " second?"
        assert outcome.output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, prompt)[0], 4)
    finally:
        store.gate.set()
        engine.close()


def test_nothing_waits_past_the_hold(tiny_llama, monkeypatch):
    monkeypatch.setattr(core_module, "HOLD_FOR_WRITE_BACK_S", 0.2)
    store = GatedStore()
    engine = make_engine(tiny_llama, chunk_size=8, cache=store, l0_bytes=0)  # with L0 nothing waits (test_l0)
    try:
        first = submit(engine, DOCUMENT + " first?")
        assert first["done"].wait(30)
        started = time.monotonic()
        follow_up = submit(engine, DOCUMENT + " second?")
        assert follow_up["done"].wait(10), "released at its deadline with the write-back still stuck"
        assert time.monotonic() - started < 5
        assert follow_up["outcome"].cached_tokens == 0  # computed, as without the hold
    finally:
        store.gate.set()
        engine.close()
