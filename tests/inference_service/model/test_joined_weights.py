"""The lean step's weights in one huge-page arena, q|k|v and gate|up joined: the model's parameters read views of it,
the forward is unchanged."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from inference_service.model.joined_weights import fused_projections
from inference_service.model.lean_step import LeanStep
from tests.factories import build_tiny_model

LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("mlp", "gate_proj"),
           ("mlp", "up_proj"))


def tiny(kind: str):
    model, _ = build_tiny_model(kind)
    return model


def weights_of(model) -> list[torch.Tensor]:
    return [getattr(getattr(layer, room), name).weight.detach().clone() for layer in model.model.layers
            for room, name in LINEARS]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases, joined too
def test_the_models_linears_read_the_joined_weights_and_its_forward_is_bitwise_the_same(kind):
    model = tiny(kind)
    tokens = torch.tensor([[3, 9, 27, 4, 11, 60]])
    with torch.inference_mode():
        before_logits = model(tokens).logits
    before = weights_of(model)
    step = LeanStep(model)
    assert step.fused and len(step.weights[0]) == 4
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv, gate_up = step.weights[1][0], step.weights[1][2]
    assert qkv.shape == (attention.q_proj.out_features + attention.k_proj.out_features
                         + attention.v_proj.out_features, attention.q_proj.in_features)
    # the model's weights are views of the joined ones: held once
    assert attention.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attention.v_proj.weight.data_ptr() == qkv[-attention.v_proj.out_features :].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gate_up[mlp.gate_proj.out_features :].data_ptr()
    if kind == "qwen2":
        assert attention.k_proj.bias.data_ptr() == step.biases[1][0][attention.q_proj.out_features :].data_ptr()
    assert all(torch.equal(old, new) for old, new in zip(before, weights_of(model)))
    with torch.inference_mode():
        assert torch.equal(model(tokens).logits, before_logits)
    again = LeanStep(model)  # a second step over the same model joins nothing again
    assert again.weights[1][0].data_ptr() == qkv.data_ptr() and torch.equal(again.weights[1][0], qkv)


def _mapping_of(address: int) -> tuple[str, list[str]]:
    """The /proc/self/smaps header line of the mapping holding address, and its VmFlags."""
    header, flags, inside = "", [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(bound, 16) for bound in first.split("-"))
            inside = start <= address < end
            if inside:
                header = line
        elif inside and first == "VmFlags:":
            flags = line.split()[1:]
    return header, flags


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("tie", [True, False])
def test_every_weight_the_step_reads_lives_in_one_huge_page_arena(tie):
    model = tiny("llama")
    if tie:  # SmolLM2's head is its embedding: placed once, and still one parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    tokens = torch.tensor([[3, 9, 27, 4, 11, 60]])
    with torch.inference_mode():
        before = model(tokens).logits
    LeanStep(model)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    headers = {name: _mapping_of(parameter.data_ptr()) for name, parameter in parameters.items()}
    arena, flags = headers["model.embed_tokens.weight"]
    assert arena, "the embedding is in no mapping"
    assert all(header == arena for header, _ in headers.values()), \
        [name for name, (header, _) in headers.items() if header != arena]
    span, _, _, _, inode, *_ = arena.split(maxsplit=5)
    assert inode == "0", f"not anonymous memory: {arena}"
    assert "hg" in flags, f"huge pages not asked for (madvise): {flags}"
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    with torch.inference_mode():
        assert torch.equal(model(tokens).logits, before)


def test_layers_with_some_qkv_biases_only_keep_the_seven_products():
    model = tiny("qwen2")
    model.model.layers[0].self_attn.k_proj.bias = None
    assert fused_projections(model.model.layers) is None
    step = LeanStep(model)
    assert not step.fused and len(step.weights[0]) == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_copy_of_a_placed_model_is_placed_in_an_arena_of_its_own():
    model = tiny("llama")
    LeanStep(model)
    twin = copy.deepcopy(model)  # what a benchmark does for a second dtype: its weights are ordinary tensors again
    LeanStep(twin)
    weight, copied = model.model.layers[0].mlp.down_proj.weight, twin.model.layers[0].mlp.down_proj.weight
    assert copied.data_ptr() != weight.data_ptr() and torch.equal(copied, weight)
    header, flags = _mapping_of(copied.data_ptr())  # (two small arenas side by side may share one mapping)
    assert header and "hg" in flags, f"the copy's weights are not in a huge-page arena: {header} {flags}"
