"""The lean decode step against transformers' own forward: bitwise equal where it runs, refused where it cannot."""
from __future__ import annotations

import pytest
import torch

from inference_service.model.attention import use_engine_attention
from inference_service.model.lean_step import LeanStep, lean_step_support
from inference_service.model.forward import prefill
from inference_service.kv_memory.kv_buffers import build_cache, kv_geometry
from inference_service.model.model_step import ModelStep
from inference_service.model.scripted_layers import decoder_layers, scripted_decoder_layers
from inference_service.kv_memory.slot_buffers import SlotBuffers
from inference_service.model.step_runner import StepRunner
from tests.factories import build_tiny_model

PROMPTS = {0: list(range(5, 25)), 2: list(range(30, 37)), 3: list(range(40, 52))}  # slot 1 stays free


def tiny(kind: str, dtype: torch.dtype = torch.float32):
    model, _ = build_tiny_model(kind)
    model = model.to(dtype)
    use_engine_attention(model)
    return model


def prefilled_slots(model) -> SlotBuffers:
    """Slots 0, 2, 3 prefilled with their prompts' K/V (the model's own prefill)."""
    slots = SlotBuffers(kv_geometry(model.config), num_slots=4, capacity=40, device=torch.device("cpu"),
                        dtype=model.dtype)
    slots.keys.zero_()
    slots.values.zero_()
    for slot, prompt in PROMPTS.items():
        prefill(model, build_cache(model.config, *slots.views(slot), 0), torch.tensor(prompt), 0)
        slots.written(slot, len(prompt))
    return slots


@pytest.mark.parametrize("loop", ["scripted", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_the_lean_step_writes_and_returns_bitwise_what_the_models_forward_does(kind, dtype, loop):
    """scripted: the layer loop as TorchScript (a CPU's); python: the same function as Python (what a GPU captures)."""
    model = tiny(kind, dtype)
    step = LeanStep(model)
    assert step.scripted and step.layers is scripted_decoder_layers, "a CPU runs the scripted loop"
    if loop == "python":
        step.layers = decoder_layers
    reference, lean = StepRunner(prefilled_slots(model), ModelStep(model)), StepRunner(prefilled_slots(model), step)
    rows = {slot: (7 + slot, len(prompt)) for slot, prompt in PROMPTS.items()}
    for index in range(6):
        if index == 3:  # a lone row, then the rows in another order than their slots
            rows = {2: rows[2]}
        if index == 4:
            rows = {3: (11, len(PROMPTS[3]) + 4), 0: (12, len(PROMPTS[0]) + 4)}
        expected, got = reference.decode(rows), lean.decode(rows)
        assert got.dtype == torch.float32 and torch.equal(expected, got), f"step {index}"
        rows = {slot: (int(row_logits.argmax()), position + 1)
                for (slot, (_, position)), row_logits in zip(rows.items(), expected)}
    assert torch.equal(reference.buffers.keys, lean.buffers.keys)
    assert torch.equal(reference.buffers.values, lean.buffers.values)


def test_models_the_lean_step_does_not_repeat_say_why():
    assert "sliding-window" in lean_step_support(tiny("mistral_sliding"))
    eager, _ = build_tiny_model("llama")
    eager.set_attn_implementation("eager")
    assert "attention 'eager'" in lean_step_support(eager)
    from transformers import GemmaConfig, GemmaForCausalLM
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    assert "model type 'gemma'" in lean_step_support(gemma)
    model = tiny("llama")
    assert lean_step_support(model) == ""
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()  # the layer loop gates with F.silu only
    assert "activation GELU is not SiLU" in lean_step_support(model)
