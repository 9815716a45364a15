"""Batched decode over fixed slots (the model's forward through a StepRunner): rows of different lengths in one
forward, each identical to its own forward."""
from __future__ import annotations

import torch

from inference_service.model.attention import use_engine_attention
from inference_service.model.forward import decode_alone, prefill
from inference_service.kv_memory.kv_buffers import allocate_kv, build_cache, kv_geometry
from inference_service.model.model_step import ModelStep
from inference_service.kv_memory.slot_buffers import SlotBuffers
from inference_service.model.step_runner import StepRunner
from tests.factories import build_tiny_model


def test_rows_of_different_lengths_decode_together_as_each_would_alone():
    model, _ = build_tiny_model("llama")
    use_engine_attention(model)
    geometry = kv_geometry(model.config)
    prompts = [list(range(5, 25)), list(range(30, 37)), list(range(40, 52))]
    slots = SlotBuffers(geometry, num_slots=4, capacity=40, device=torch.device("cpu"),
                        dtype=torch.float32)
    alone, rows = [], {}
    for slot, prompt in zip((0, 2, 3), prompts):  # slot 1 stays free: its row in the forward is never read
        keys, values = slots.views(slot)
        first, _ = prefill(model, build_cache(model.config, keys, values, 0), torch.tensor(prompt), 0)
        slots.written(slot, len(prompt))
        token = int(first.argmax())
        rows[slot] = (token, len(prompt))
        # the same row alone, in a request-sized buffer of its own
        own = build_cache(model.config, *allocate_kv(geometry, 40, "cpu", torch.float32), 0)
        own_first, _ = prefill(model, own, torch.tensor(prompt), 0)
        alone.append([int(own_first.argmax())])
        for step in range(4):
            alone[-1].append(int(decode_alone(model, own, torch.tensor(alone[-1][-1]), len(prompt) + step).argmax()))
    together = {slot: [token] for slot, (token, _) in rows.items()}
    runner = StepRunner(slots, ModelStep(model))
    for _ in range(4):
        rows = dict(reversed(rows.items()))  # the logits follow the order asked for, not the slots'
        logits = runner.decode(rows)  # [3, vocab], in the order of rows
        rows = {slot: (int(row_logits.argmax()), position + 1)
                for (slot, (_, position)), row_logits in zip(rows.items(), logits)}
        for slot, (token, _) in rows.items():
            together[slot].append(token)
    assert [together[slot] for slot in (0, 2, 3)] == alone


def test_columns_a_row_reads_masked_are_made_finite_first():
    model, _ = build_tiny_model("llama")
    geometry = kv_geometry(model.config)
    slots = SlotBuffers(geometry, num_slots=2, capacity=16, device=torch.device("cpu"),
                        dtype=torch.float32)
    slots.keys.fill_(float("nan"))  # what reused memory may hold
    slots.values.fill_(float("nan"))
    for slot, length in ((0, 3), (1, 9)):
        keys, values = slots.views(slot)
        prefill(model, build_cache(model.config, keys, values, 0), torch.arange(length) + 5, 0)
        slots.written(slot, length)
    logits = StepRunner(slots, ModelStep(model)).decode({0: (7, 3), 1: (8, 9)})  # row 0 reads columns 4..9 masked
    assert bool(torch.isfinite(logits).all())
    assert bool(torch.isfinite(slots.values[:, 0, :, :10]).all())
