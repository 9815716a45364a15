"""The lean decode step against transformers' own forward: bitwise equal where it runs, refused where it cannot."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from inference_service.model import decode_step, step_choice
from inference_service.model.attention import use_engine_attention
from inference_service import mkl_dispatch
from inference_service.model.decode_step import (Linear, LeanStep, RmsNorm, lean_step_support, project, split_support,
                                                  wide_support)
from inference_service.model.forward import prefill
from inference_service.model.kv_buffers import build_cache, kv_geometry
from inference_service.model.slot_buffers import SlotBuffers
from inference_service.model.step_choice import choose_decode_step, probe_mismatch
from tests.factories import build_tiny_model

PROMPTS = {0: list(range(5, 25)), 2: list(range(30, 37)), 3: list(range(40, 52))}  # slot 1 stays free


def tiny(kind: str, dtype: torch.dtype = torch.float32):
    model, _ = build_tiny_model(kind)
    model = model.to(dtype)
    use_engine_attention(model)
    return model


def prefilled_slots(model) -> SlotBuffers:
    """Slots 0, 2, 3 prefilled with their prompts' K/V (the model's own prefill)."""
    slots = SlotBuffers(model.config, kv_geometry(model.config), num_slots=4, capacity=40, device=torch.device("cpu"),
                        dtype=model.dtype)
    slots.keys.zero_()
    slots.values.zero_()
    for slot, prompt in PROMPTS.items():
        prefill(model, build_cache(model.config, *slots.views(slot), 0), torch.tensor(prompt), 0)
        slots.written(slot, len(prompt))
    return slots


@pytest.mark.parametrize("variant", ["lean", "lean-python-loop", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_lean_step_writes_and_returns_bitwise_what_the_models_forward_does(kind, dtype, variant):
    """lean runs its layers as one TorchScript call on a CPU; lean-python-loop the same step without it (what other
    activations get); split the projections' halves on two threads."""
    split = variant == "split"
    declined = split_support(torch.device("cpu"))
    if split and dtype == torch.float32 and declined:
        # Under --mkl-dispatch features MKL threads the one-row float32 product itself, rows cut its own way, so
        # split halves are not bitwise (the engine's probe refuses them too) and split_support declines them.
        pytest.skip(f"split declined here: {declined}")
    model = tiny(kind, dtype)
    reference, lean = prefilled_slots(model), prefilled_slots(model)
    lean.step = LeanStep(model, split=split)
    assert (lean.step.scripted is not None) == (not split)
    if variant == "lean-python-loop":
        lean.step.scripted = None
    rows = {slot: (7 + slot, len(prompt)) for slot, prompt in PROMPTS.items()}
    for step in range(6):
        if step == 3:  # a lone row, then the rows in another order than their slots
            rows = {2: rows[2]}
        if step == 4:
            rows = {3: (11, len(PROMPTS[3]) + 4), 0: (12, len(PROMPTS[0]) + 4)}
        expected, got = reference.decode(model, rows), lean.decode(model, rows)
        assert got.dtype == torch.float32 and torch.equal(expected, got), f"step {step}"
        rows = {slot: (int(row_logits.argmax()), position + 1)
                for (slot, (_, position)), row_logits in zip(rows.items(), expected)}
    assert torch.equal(reference.keys, lean.keys) and torch.equal(reference.values, lean.values)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_engine_chooses_the_lean_step_after_its_probe(kind):
    choice = choose_decode_step(tiny(kind), "lean")
    assert (choice.name, choice.reason) == ("lean", "") and isinstance(choice.step, LeanStep)
    assert not choice.step.packed and not choice.step.split


@pytest.mark.skipif(bool(split_support(torch.device("cpu"))),
                    reason=f"split declined here: {split_support(torch.device('cpu'))}")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_split_step_runs_after_its_probe(kind):
    choice = choose_decode_step(tiny(kind), "split")
    assert (choice.name, choice.reason) == ("split", "") and choice.step.split and not choice.step.packed


def test_a_weight_is_cut_on_aligned_rows_and_a_small_one_not_at_all():
    """A cut inside MKL's row blocks rounds differently (a 260-row head cut at 130 did); at 128 it does not."""
    head = Linear.of(torch.nn.Linear(64, 260, bias=True), split=True)
    assert [half.shape[0] for half in head.halves] == [128, 132] and head.bias_halves[0].shape[0] == 128
    small = Linear.of(torch.nn.Linear(64, 32, bias=False), split=True)
    assert [half.shape[0] for half in small.halves] == [32, 0]
    x = torch.randn(3, 1, 64)
    for linear, module_rows in ((head, 260), (small, 32)):
        whole = torch.nn.functional.linear(x, linear.weight, linear.bias)
        assert torch.equal(project(x, (linear,))[0], whole) and whole.shape[-1] == module_rows


def test_split_is_declined_where_mkl_already_threads_the_one_row_product(monkeypatch):
    monkeypatch.setattr(mkl_dispatch, "_applied", mkl_dispatch.Dispatch("auto", "features", "test"))
    assert "every intra-op thread" in split_support(torch.device("cpu"))
    monkeypatch.setattr(mkl_dispatch, "_applied", mkl_dispatch.Dispatch("vendor", "vendor", "test"))
    assert "every intra-op thread" not in split_support(torch.device("cpu"))


def test_split_falls_back_to_lean_with_the_reason(monkeypatch):
    _, build, described = step_choice.LEAN_VARIANTS["split"]
    monkeypatch.setitem(step_choice.LEAN_VARIANTS, "split",
                        (lambda device: "torch's inter-op pool has one thread", build, described))
    choice = choose_decode_step(tiny("llama"), "split")
    assert choice.name == "lean" and not choice.step.split and "one thread" in choice.reason


def test_wide_is_a_cpu_path_and_falls_back_to_lean_elsewhere(monkeypatch):
    assert "CPU path" in wide_support(torch.device("cuda"))
    assert wide_support(torch.device("cpu")) == ""
    _, build, described = step_choice.LEAN_VARIANTS["wide"]
    monkeypatch.setitem(step_choice.LEAN_VARIANTS, "wide", (lambda device: wide_support(torch.device("cuda")), build,
                                                            described))
    choice = choose_decode_step(tiny("llama"), "wide")
    assert choice.name == "lean" and not choice.step.wide and "CPU path" in choice.reason


def test_a_step_that_rounds_differently_is_refused_and_the_models_forward_runs(monkeypatch):
    model = tiny("llama")

    class Perturbed(LeanStep):
        """The first norm's epsilon doubled: logits a rounding apart from the model's."""

        def __init__(self, model, pack_rows: int = 0) -> None:
            super().__init__(model, pack_rows)
            first = self.layers[0]
            self.layers[0] = dataclasses.replace(first, input_norm=RmsNorm(first.input_norm.weight,
                                                                           first.input_norm.eps * 2))
            self.scripted = decode_step._script_arguments(self.layers)  # the scripted layers see it too

    assert "differ" in probe_mismatch(model, Perturbed(model))
    monkeypatch.setattr(step_choice, "LeanStep", Perturbed)
    choice = choose_decode_step(model, "lean")
    assert choice.step is None and choice.name == "transformers" and "differ" in choice.reason


def test_models_the_lean_step_does_not_repeat_run_the_models_forward_and_say_why():
    sliding = tiny("mistral_sliding")
    assert "sliding-window" in lean_step_support(sliding)
    eager, _ = build_tiny_model("llama")
    eager.set_attn_implementation("eager")
    assert "attention 'eager'" in lean_step_support(eager)
    from transformers import GemmaConfig, GemmaForCausalLM
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    assert "model type 'gemma'" in lean_step_support(gemma)
    choice = choose_decode_step(gemma)
    assert choice.step is None and choice.name == "transformers" and "gemma" in choice.reason
    assert choose_decode_step(tiny("llama"), "transformers") == step_choice.StepChoice(None, "transformers", "")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_the_wide_step_is_the_models_forward_for_one_row_and_close_for_many(kind):
    model = tiny(kind)
    choice = choose_decode_step(model, "wide")
    assert choice.name == "wide" and choice.step.wide and not choice.step.packed
    one = {2: (7, len(PROMPTS[2]))}
    reference, wide = prefilled_slots(model), prefilled_slots(model)
    wide.step = choice.step
    assert torch.equal(reference.decode(model, one), wide.decode(model, one))
    assert torch.equal(reference.keys, wide.keys) and torch.equal(reference.values, wide.values)
    rows = {slot: (7 + slot, len(prompt)) for slot, prompt in PROMPTS.items()}
    expected, got = reference.decode(model, rows), wide.decode(model, rows)
    assert torch.allclose(expected, got, rtol=1e-4, atol=1e-5)
    layer = choice.step.layers[0]
    assert torch.equal(layer.gate.transposed, layer.gate.weight.t())  # a copy of the same weight, transposed
    assert layer.gate.transposed.is_contiguous()


def test_a_wide_linear_runs_one_row_through_f_linear_and_several_through_the_transposed_copy():
    module = torch.nn.Linear(64, 48, bias=True)
    wide = Linear.of(module, wide=True)
    rows = torch.randn(5, 1, 64)
    weight, bias = module.weight.detach(), module.bias.detach()
    with torch.inference_mode():
        assert torch.equal(wide(rows[:1]), F.linear(rows[:1], weight, bias))
        several = wide(rows)
        assert several.shape == (5, 1, 48)
        assert torch.equal(several, torch.addmm(bias, rows.reshape(5, 64), weight.t().contiguous()).view(5, 1, 48))
        without_bias = Linear.of(torch.nn.Linear(64, 48, bias=False), wide=True)
        assert torch.equal(without_bias(rows), (rows.reshape(5, 64) @ without_bias.transposed).view(5, 1, 48))


def test_the_onednn_step_rounds_close_to_the_models_forward():
    model = tiny("llama")
    reference, packed = prefilled_slots(model), prefilled_slots(model)
    packed.step = choose_decode_step(model, "onednn").step
    assert packed.step is not None and packed.step.packed
    rows = {slot: (7 + slot, len(prompt)) for slot, prompt in PROMPTS.items()}
    expected, got = reference.decode(model, rows), packed.decode(model, rows)
    assert torch.allclose(expected, got, rtol=1e-4, atol=1e-5)


def test_only_plain_silu_layers_on_a_cpu_are_scripted():
    model = tiny("llama")
    assert LeanStep(model).scripted is not None
    assert LeanStep(model, wide=True).scripted is None  # several rows through transposed weights
    assert LeanStep(model, split=True).scripted is None
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert LeanStep(model).scripted is None
