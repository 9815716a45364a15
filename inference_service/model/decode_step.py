"""A decode step written over the HF module's own weights: the same ATen ops as transformers' forward, no plumbing.

For one new token per row, transformers' Llama/Mistral/Qwen2 decoder runs, per layer: RMSNorm, the q/k/v
projections, RoPE, the cache write, SDPA (query groups folded into the batch: `pack_gqa`), the output
projection, RMSNorm and the gated MLP. LeanStep calls those ops in that order on the same tensors, so at any dtype
its logits are bitwise the model's own (step_choice checks it at start-up on a probe); what it leaves out is the
per-call machinery around them (output dataclasses, Cache objects, mask preprocessing, kwargs merging, hooks).

On a CPU the plain lean step runs its layers as one TorchScript function (model/scripted_layers.py): the same
ops in the same order without Python between them (1.08x at 1 and 8 rows on the dev machine), bitwise the same.

With `split` (opt-in) every projection's weight rows are cut in two halves and the halves run at once, one on the
calling thread and one on torch's inter-op pool (TorchScript fork, no GIL). It helps only where MKL's one-row fp32
product is single-threaded (MKL's own dispatch on a non-Intel CPU: ~18 GB/s of the memory's ~53); each output
element is then the same dot product over the same inputs in the same kernel, so the logits stay bitwise the
model's own (step_choice's probe checks it). Under `--mkl-dispatch features` MKL threads the product itself and
split_support declines it.

With `packed_matmuls` the projections run as oneDNN linears over weights reordered once into oneDNN's blocked
layout instead of transformers' F.linear (MKL on CPU): on this machine's AMD cores that was ~2x faster at one row
under MKL's own dispatch and is ~1.6x at 16 rows under `features` (docs/performance.md), but it sums in another
order, so it is not exact.

With `wide` (opt-in) a call of one row is lean's own F.linear (bitwise), and a call of several rows multiplies a
transposed, contiguous copy of each weight ([in, out]) instead: MKL's float32 product of a few rows by a
non-transposed right operand runs 1.3x (8 rows) to 1.6x (16 rows) faster per step on this machine's AMD cores than
F.linear's transposed one (docs/performance.md), at the price of a second copy of every weight. Rows decoded
together then sum in another order than the model's batched forward, so it is opt-in, and its answers' K/V are not
stored, like onednn's.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from inference_service import mkl_dispatch
from inference_service.model.batch_forward import has_sliding_layers
from inference_service.model.scripted_layers import rms_norm, rotate_half, scripted_decoder_layers

LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})  # decoders whose forward LeanStep repeats op for op
SDPA_IMPLEMENTATIONS = frozenset({"sdpa", "kvboost_sdpa"})  # kvboost_sdpa runs transformers' SDPA for one query


def lean_step_support(model) -> str:
    """Why LeanStep cannot stand in for this model's decode forward; '' when it can (then step_choice verifies)."""
    config = model.config
    model_type = getattr(config, "model_type", "")
    if model_type not in LEAN_MODEL_TYPES:
        return f"model type {model_type!r} is not one the lean step repeats ({', '.join(sorted(LEAN_MODEL_TYPES))})"
    attention = getattr(config, "_attn_implementation", None)
    if attention not in SDPA_IMPLEMENTATIONS:
        return f"attention {attention!r}: the lean step repeats transformers' SDPA attention only"
    if has_sliding_layers(config):
        return "sliding-window layers (their rows decode one at a time through transformers)"
    decoder = getattr(model, "model", None)
    if decoder is None or not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} does not have the Llama module layout"
    for layer in decoder.layers:
        attention_module, mlp = layer.self_attn, layer.mlp
        if any(hasattr(attention_module, name) for name in ("q_norm", "k_norm")):
            return "query/key norms inside attention"
        if not all(isinstance(getattr(attention_module, name, None), torch.nn.Linear)
                   for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention projections that are not separate linear layers"
        if not all(isinstance(getattr(mlp, name, None), torch.nn.Linear) for name in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP that is not gate/up/down linear layers"
        if type(layer.input_layernorm).__name__ not in _RMS_NORMS or type(layer.post_attention_layernorm).__name__ not in _RMS_NORMS:
            return f"normalization {type(layer.input_layernorm).__name__} is not the Llama RMSNorm"
    return ""


_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})


def packed_matmul_support(device: torch.device, dtype: torch.dtype) -> str:
    """Why oneDNN packed linears cannot run here; '' when they can."""
    if device.type != "cpu":
        return f"oneDNN packed linears are a CPU path; the model is on {device.type}"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN packed linears take float32 or bfloat16, not {dtype}"
    return ""


# TorchScript, deprecated in torch 2.x but the one way eager code has to run a function on torch's inter-op pool
# without the GIL (torch.jit.fork); torch is pinned, and tests/inference_service/model/test_decode_step.py fails
# loudly if a later torch changes what these return.
def _linears(x: torch.Tensor, weights: List[torch.Tensor], biases: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    return [F.linear(x, weight, bias) for weight, bias in zip(weights, biases)]


def _split_linears(x: torch.Tensor, firsts: List[torch.Tensor], first_biases: List[Optional[torch.Tensor]],
                   seconds: List[torch.Tensor], second_biases: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """F.linear(x, W, b) for each projection, the second halves of W's rows on the inter-op pool meanwhile."""
    future = torch.jit.fork(_linears, x, seconds, second_biases)
    heads = _linears(x, firsts, first_biases)
    tails = torch.jit.wait(future)
    return [torch.cat([head, tail], dim=-1) for head, tail in zip(heads, tails)]


SPLIT_ALIGN = 64  # rows: where a weight may be cut and each output still be the same dot product as uncut


with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
    _linears = torch.jit.script(_linears)
    _split_linears = torch.jit.script(_split_linears)


def split_support(device: torch.device) -> str:
    """Why split projections cannot help here; '' when they can."""
    if device.type != "cpu":
        return f"split projections are a CPU path; the model is on {device.type}"
    if torch.get_num_interop_threads() < 2:
        return "torch's inter-op pool has one thread"
    dispatch = mkl_dispatch.current()
    if dispatch is not None and dispatch.applied == "features":
        # Measured (docs/performance.md): the halves' second OpenMP team then competes with MKL's own threads and
        # every step of the process slows, 14.6 -> 25.9 ms at one row on two cores.
        return "MKL already runs the one-row product on every intra-op thread (--mkl-dispatch features)"
    return ""


def wide_support(device: torch.device) -> str:
    """Why wide projections cannot help here; '' when they can."""
    if device.type != "cpu":
        return f"wide projections are a CPU path (MKL's few-row products); the model is on {device.type}"
    return ""


@dataclass(slots=True, frozen=True)
class Linear:
    """y = x W^T + b, through F.linear (what nn.Linear runs), a oneDNN linear over weights packed once, or, for
    several rows, a product with a transposed copy of W (wide)."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout
    halves: tuple[torch.Tensor, torch.Tensor] | None = None  # the weight's rows cut in two (views, no copy)
    bias_halves: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    transposed: torch.Tensor | None = None  # [in, out], contiguous: the product of many rows

    @classmethod
    def of(cls, module: torch.nn.Linear, pack_rows: int = 0, split: bool = False, wide: bool = False) -> Linear:
        """pack_rows > 0: packs the weight for oneDNN, tuned for that many rows per call. split: keeps views of
        the two halves of the weight's rows (and of the bias) for project(). wide: keeps a transposed copy of the
        weight for calls of several rows."""
        weight = module.weight.detach()
        bias = None if module.bias is None else module.bias.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, pack_rows) if pack_rows else None
        if wide:
            return cls(weight, bias, transposed=weight.t().contiguous())
        if not split:
            return cls(weight, bias, packed)
        # the cut on a multiple of SPLIT_ALIGN rows: MKL's kernels handle a ragged tail of rows in another order
        # (a 260-row weight cut at 130 rounds differently from the whole; cut at 128 it does not)
        # (a weight too small to cut keeps all its rows in the first half and none in the second)
        cut = min(weight.shape[0], max(SPLIT_ALIGN, weight.shape[0] // 2 // SPLIT_ALIGN * SPLIT_ALIGN))
        bias_halves = (None, None) if bias is None else (bias[:cut], bias[cut:])
        return cls(weight, bias, packed, (weight[:cut], weight[cut:]), bias_halves)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed is not None and x.shape[0] > 1:  # x: [rows, 1, in]
            flat = x.reshape(-1, x.shape[-1])
            product = (torch.mm(flat, self.transposed) if self.bias is None
                       else torch.addmm(self.bias, flat, self.transposed))
            return product.view(*x.shape[:-1], -1)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def project(x: torch.Tensor, linears: tuple[Linear, ...]) -> list[torch.Tensor]:
    """Each linear applied to x: the halves of all of them at once when they are split, else one by one."""
    if linears[0].halves is None:
        return [linear(x) for linear in linears]
    return _split_linears(x, [linear.halves[0] for linear in linears], [linear.bias_halves[0] for linear in linears],
                          [linear.halves[1] for linear in linears], [linear.bias_halves[1] for linear in linears])


@dataclass(slots=True, frozen=True)
class RmsNorm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass(slots=True, frozen=True)
class LayerWeights:
    input_norm: RmsNorm
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    scaling: float
    post_norm: RmsNorm
    gate: Linear
    up: Linear
    down: Linear
    act: torch.nn.Module


class LeanStep:
    """One token for each of a step's rows, over the K/V owner's slots (see SlotBuffers.decode)."""

    def __init__(self, model, pack_rows: int = 0, split: bool = False, wide: bool = False) -> None:
        """pack_rows > 0: projections through oneDNN packed weights (not exact; see the module docstring).
        wide: projections of several rows through a transposed copy of each weight (one row exact; see there).
        split: every projection's weight halves run at once on two threads (exact; see the module docstring)."""
        assert (bool(pack_rows) + split + wide) <= 1, "packed, split and wide projections are different steps"
        decoder = model.model
        config = model.config
        self.head_dim = decoder.layers[0].self_attn.head_dim
        self.num_kv_heads = config.num_key_value_heads
        self.groups = config.num_attention_heads // self.num_kv_heads
        self.embedding = decoder.embed_tokens.weight.detach()
        self.rotary = decoder.rotary_emb  # the module itself: every RoPE type computes cos/sin as the model does
        self.final_norm = _norm(decoder.norm)
        self.lm_head = Linear.of(model.lm_head, pack_rows, split, wide)
        self.layers = [_layer(layer, pack_rows, split, wide) for layer in decoder.layers]
        self.packed = bool(pack_rows)
        self.wide = wide
        self.exact = not (self.packed or wide)  # every call bitwise the model's forward over the same rows
        self.split = split
        # The layers as one TorchScript call (model/scripted_layers.py) on a CPU where every projection is plain
        # F.linear and every MLP SiLU-gated; None: the Python loop below. Not on a GPU: TorchScript's GPU fuser
        # would fuse the pointwise ops (other roundings), and CUDA graphs already remove the per-op cost there.
        # (Nor where TorchScript could fuse CPU ops, which the pinned torch does not: checked, not assumed.)
        on_cpu = self.embedding.device.type == "cpu" and not torch._C._jit_can_fuse_on_cpu()
        self.scripted = _script_arguments(self.layers) if self.exact and not split and on_cpu else None

    @torch.inference_mode()
    def __call__(self, keys: torch.Tensor, values: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                 columns: torch.Tensor, length: int, mask: torch.Tensor) -> torch.Tensor:
        """Writes each row's new K/V at its column and returns logits [rows, vocab] (float32).

        keys, values: [layers, rows, kv_heads, capacity, head_dim] (the step's slots); token_ids: [rows, 1];
        positions, columns: [rows]; mask: bool [rows, 1, 1, length], True where a row may attend.
        """
        num_rows = token_ids.shape[0]
        rows = torch.arange(num_rows, device=token_ids.device)
        hidden = F.embedding(token_ids, self.embedding)  # [rows, 1, hidden]
        cos, sin = self.rotary(hidden, positions.view(num_rows, 1))  # [rows, 1, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [rows, 1, 1, head_dim], over the heads
        if self.scripted is not None:
            hidden = scripted_decoder_layers(hidden, keys, values, rows, columns, length, mask, cos, sin,
                                             *self.scripted, self.head_dim, self.num_kv_heads, self.groups)
            return project(self.final_norm(hidden), (self.lm_head,))[0][:, -1].float()
        for index, layer in enumerate(self.layers):
            attended = self._attention(layer, layer.input_norm(hidden), keys[index], values[index], rows, columns,
                                       length, mask, cos, sin)
            hidden = hidden + attended
            gate, up = project(layer.post_norm(hidden), (layer.gate, layer.up))
            hidden = hidden + project(layer.act(gate) * up, (layer.down,))[0]
        return project(self.final_norm(hidden), (self.lm_head,))[0][:, -1].float()

    def _attention(self, layer: LayerWeights, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   rows: torch.Tensor, columns: torch.Tensor, length: int, mask: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        query, key, value = project(x, (layer.q, layer.k, layer.v))
        query = query.view(num_rows, 1, -1, self.head_dim).transpose(1, 2)  # [rows, heads, 1, head_dim]
        key = key.view(num_rows, 1, -1, self.head_dim).transpose(1, 2)  # [rows, kv_heads, 1, head_dim]
        value = value.view(num_rows, 1, -1, self.head_dim).transpose(1, 2)
        query = (query * cos) + (rotate_half(query) * sin)
        key = (key * cos) + (rotate_half(key) * sin)
        keys[rows, :, columns] = key[:, :, 0]  # keys: [rows, kv_heads, capacity, head_dim]
        values[rows, :, columns] = value[:, :, 0]
        if self.groups > 1:  # one query token: its heads' groups become the query length (transformers' pack_gqa)
            query = query.reshape(num_rows, self.num_kv_heads, self.groups, self.head_dim)
        output = F.scaled_dot_product_attention(query, keys[:, :, :length], values[:, :, :length], attn_mask=mask,
                                                dropout_p=0.0, scale=layer.scaling, is_causal=False)
        output = output.reshape(num_rows, -1, 1, self.head_dim).transpose(1, 2).contiguous()  # [rows, 1, heads, dim]
        return project(output.reshape(num_rows, 1, -1).contiguous(), (layer.o,))[0]


def _script_arguments(layers: list[LayerWeights]) -> tuple | None:
    """(weights, biases, norms, eps, scalings) for scripted_decoder_layers, or None where a layer cannot go there."""
    for layer in layers:
        linears = (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down)
        if not _plain_silu(layer.act) or any(linear.packed is not None or linear.halves is not None
                                                       or linear.transposed is not None for linear in linears):
            return None
    order = [(layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down) for layer in layers]
    return ([[linear.weight for linear in linears] for linears in order],
            [[linear.bias for linear in linears] for linears in order],
            [[layer.input_norm.weight, layer.post_norm.weight] for layer in layers],
            [[float(layer.input_norm.eps), float(layer.post_norm.eps)] for layer in layers],
            [float(layer.scaling) for layer in layers])


def _plain_silu(act: torch.nn.Module) -> bool:
    """F.silu and nothing else: torch's SiLU, or transformers' SiLUActivation with its own forward (not a kernel
    from the Hub swapped in)."""
    if type(act) is torch.nn.SiLU:
        return True
    return type(act).__name__ == "SiLUActivation" and getattr(type(act).forward, "__qualname__", "") == \
        "SiLUActivation.forward" and "forward" not in vars(act)


def _norm(module) -> RmsNorm:
    return RmsNorm(module.weight.detach(), module.variance_epsilon)


def _layer(layer, pack_rows: int, split: bool, wide: bool) -> LayerWeights:
    attention, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        input_norm=_norm(layer.input_layernorm),
        q=Linear.of(attention.q_proj, pack_rows, split, wide), k=Linear.of(attention.k_proj, pack_rows, split, wide),
        v=Linear.of(attention.v_proj, pack_rows, split, wide), o=Linear.of(attention.o_proj, pack_rows, split, wide),
        scaling=attention.scaling,
        post_norm=_norm(layer.post_attention_layernorm),
        gate=Linear.of(mlp.gate_proj, pack_rows, split, wide), up=Linear.of(mlp.up_proj, pack_rows, split, wide),
        down=Linear.of(mlp.down_proj, pack_rows, split, wide),
        act=mlp.act_fn)
