"""The decode step chosen at start-up: lean after its probe finds it bitwise the model's forward, else the model's
forward with the reason; graphs only where the device has them."""
from __future__ import annotations

import pytest

from inference_service.model import step_runner
from inference_service.model.lean_step import LeanStep
from inference_service.model.kv_buffers import kv_geometry
from inference_service.model.model_step import ModelStep
from inference_service.model.slot_buffers import SlotBuffers
from inference_service.model.step_names import current_decode_step
from inference_service.model.step_runner import choose_runner, probe_mismatch
from tests.factories import build_tiny_model
from tests.inference_service.model.test_lean_step import tiny


def slots_of(model) -> SlotBuffers:
    return SlotBuffers(kv_geometry(model.config), 4, 40, model.device, model.dtype)


class Perturbed(LeanStep):
    """The first norm's epsilon doubled: logits a rounding apart from the model's."""

    def __init__(self, model) -> None:
        super().__init__(model)
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
