"""The decode step chosen at start-up: lean after its probe finds it bitwise the model's forward, else the model's
forward with the reason; graphs only where the device has them."""
from __future__ import annotations

import pytest
import torch

from inference_service.model import step_runner
from inference_service.model.lean_step import LeanStep
from inference_service.kv_memory.kv_buffers import kv_geometry
from inference_service.model.model_step import ModelStep
from inference_service.kv_memory.slot_buffers import SlotBuffers
from inference_service.model.step_names import current_decode_step
from inference_service.model.step_runner import choose_runner, probe_mismatch
from tests.factories import build_tiny_model
from tests.inference_service.model.test_lean_step import tiny


def slots_of(model) -> SlotBuffers:
    return SlotBuffers(kv_geometry(model.config), 4, 40, model.device, model.dtype)


class Perturbed(LeanStep):
    """The first norm's epsilon doubled: logits a rounding apart from the model's."""

    def __init__(self, model, **options) -> None:
        super().__init__(model, **options)
        self.eps[0][0] *= 2


class JoinedApart(LeanStep):
    """Rounds apart from the model's forward with the joined products only (as a CPU whose wider product reduced
    otherwise would)."""

    def __init__(self, model, **options) -> None:
        super().__init__(model, **options)
        if self.fused:
            self.eps[0][0] *= 2


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_engine_chooses_the_lean_step_after_its_probe(kind):
    model = tiny(kind)
    buffers = slots_of(model)
    runner = choose_runner(model, buffers, "lean")
    assert (runner.name, runner.reason) == ("lean", "") and isinstance(runner.step, LeanStep)
    assert runner.buffers is buffers and runner.graphs is None, "no graphs on a CPU"


def test_a_step_that_rounds_differently_is_refused_and_the_models_forward_runs(monkeypatch):
    model = tiny("llama")
    assert "differ" in probe_mismatch(model, Perturbed(model))
    assert probe_mismatch(model, LeanStep(model)) == ""
    monkeypatch.setattr(step_runner, "LeanStep", Perturbed)
    runner = choose_runner(model, slots_of(model), "lean")
    assert isinstance(runner.step, ModelStep) and runner.name == "transformers" and "differ" in runner.reason


def test_joined_products_that_round_apart_give_way_to_the_seven_products(monkeypatch):
    model = tiny("llama")
    assert LeanStep(model).fused, "a CPU joins q|k|v and gate|up"
    monkeypatch.setattr(step_runner, "LeanStep", JoinedApart)
    runner = choose_runner(model, slots_of(model), "lean")
    assert (runner.name, runner.reason) == ("lean", "") and not runner.step.fused
    assert len(runner.step.weights[0]) == 7


def test_models_the_lean_step_does_not_repeat_run_the_models_forward_and_say_why():
    sliding = tiny("mistral_sliding")
    runner = choose_runner(sliding, slots_of(sliding))
    assert runner.name == "transformers" and "sliding-window" in runner.reason
    model = tiny("llama")
    asked = choose_runner(model, slots_of(model), "transformers")
    assert isinstance(asked.step, ModelStep) and (asked.name, asked.reason) == ("transformers", "")


def test_retired_steps_name_the_lean_step_with_a_warning():
    assert current_decode_step("lean") == ("lean", "")
    assert current_decode_step("transformers") == ("transformers", "")
    for retired in ("split", "wide", "onednn"):
        step, warning = current_decode_step(retired)
        assert step == "lean" and f"--decode-step {retired} was retired" in warning


def test_the_model_step_keeps_one_cache_per_view_of_the_slots():
    model, _ = build_tiny_model("llama")
    buffers = slots_of(model)
    step = ModelStep(model)
    first = step._cache(buffers.keys[:, 0:2], buffers.values[:, 0:2])
    assert step._cache(buffers.keys[:, 0:2], buffers.values[:, 0:2]) is first
    assert step._cache(buffers.keys[:, 1:3], buffers.values[:, 1:3]) is not first


class Neighbourly(LeanStep):
    """As the invariant step, every row's logits nudged by the mean of all rows' token ids: rows that depend on each
    other (as the plain lean step, bitwise the model's forward)."""

    def __call__(self, keys, values, token_ids, positions, columns, length, mask):
        logits = super().__call__(keys, values, token_ids, positions, columns, length, mask)
        return logits + token_ids.float().mean() * 1e-3 if self.attention_block else logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_invariant_step_passes_its_probe_and_runs_every_slot_as_a_row(dtype):
    model = tiny("qwen2", dtype)
    runner = choose_runner(model, slots_of(model), "lean", invariant=True)
    assert runner.name == "lean+invariant" and runner.invariant
    assert runner.readable_columns(10) == 40  # whole blocks, capped at the capacity
    logits = runner.decode({2: (5, 3)})
    assert logits.shape[0] == 1 and torch.isfinite(logits).all()


def test_a_step_whose_rows_depend_on_each_other_fails_the_invariance_probe(monkeypatch):
    model = tiny("llama", torch.bfloat16)
    monkeypatch.setattr(step_runner, "LeanStep", Neighbourly)
    runner = choose_runner(model, slots_of(model), "lean", invariant=True)
    assert runner.name == "lean" and not runner.invariant  # off, and the log says why
    step = Neighbourly(model)
    step.attention_block = step_runner.INVARIANT_ATTENTION_BLOCK
    assert "differs beside other rows" in step_runner.probe_invariance(model, step)
