"""K/V slots sized by --kv-cache-bytes (as on a GPU, where memory is committed at allocation): the slots' memory
stays within the budget, requests that fit are still model.generate's, and one that never can is refused."""
from __future__ import annotations

import pytest

from inference_service.kv_memory.slot_ledger import SlotLayout
from inference_service.errors import InvalidRequest
from kvboost_keys.prompts import tokenize_prompt
from tests.inference_service.engine.test_engine import make_engine, reference_ids, run, text_of_length

PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 kv heads x 16 head dims x fp32: the tiny models'


def slot_bytes(engine) -> int:
    buffers = engine.core.owner.buffers
    return buffers.keys.numel() * buffers.keys.element_size() + buffers.values.numel() * buffers.values.element_size()


def test_the_slots_memory_stays_within_the_budget_and_answers_stay_exact(tiny_llama):
    budget = 3 * 4098 * PER_TOKEN + 100  # three slots of the whole 4096-token context (+1, +1 scratch)
    engine = make_engine(tiny_llama, kv_slots_by_budget=True, kv_cache_bytes=budget)
    try:
        assert engine.core.layout == SlotLayout(3, 4097, True)
        assert slot_bytes(engine) <= budget
        prompt = text_of_length(70)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        assert [run(engine, prompt=prompt).output_token_ids for _ in range(2)] == [expected, expected]
        with pytest.raises(InvalidRequest, match="rows"):  # four completions need four slots
            run(engine, prompt=prompt, n=4, temperature=1.0, seed=1)
    finally:
        engine.close()


def test_a_budget_below_one_whole_slot_refuses_what_cannot_fit_and_serves_the_rest(tiny_llama):
    engine = make_engine(tiny_llama, kv_slots_by_budget=True, kv_cache_bytes=100 * PER_TOKEN)
    try:
        assert engine.core.layout == SlotLayout(1, 99, True)
        with pytest.raises(InvalidRequest, match="a slot holds 99 tokens"):
            run(engine, prompt=text_of_length(120))
        prompt = text_of_length(50)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        assert run(engine, prompt=prompt).output_token_ids == expected
    finally:
        engine.close()


def test_on_a_cpu_by_default_the_layout_is_not_cut_by_the_budget(tiny_llama):
    engine = make_engine(tiny_llama, kv_cache_bytes=100 * PER_TOKEN)
    try:
        assert not engine.core.layout.by_budget and engine.core.layout.capacity == 4097
    finally:
        engine.close()
