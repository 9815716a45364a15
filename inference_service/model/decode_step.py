"""A decode step written over the HF module's own weights: the same ATen ops as transformers' forward, no plumbing.

For one new token per row, transformers' Llama/Mistral/Qwen2 decoder runs, per layer: RMSNorm, the q/k/v
projections, RoPE, the cache write, SDPA (query groups folded into the batch: `pack_gqa`), the output
projection, RMSNorm and the gated MLP. LeanStep calls those ops in that order on the same tensors, so at any dtype
its logits are bitwise the model's own (step_choice checks it at start-up on a probe); what it leaves out is the
per-call machinery around them (output dataclasses, Cache objects, mask preprocessing, kwargs merging, hooks).

With `packed_matmuls` the projections run as oneDNN linears over weights reordered once into oneDNN's blocked
layout instead of transformers' F.linear (MKL on CPU): on this machine's AMD cores that reads the weights ~1.8x
faster at one row and ~2.2x at 16 (docs/performance.md), but it sums in another order, so it is not exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference_service.model.batch_forward import has_sliding_layers

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


@dataclass(slots=True, frozen=True)
class Linear:
    """y = x W^T + b, through F.linear (what nn.Linear runs) or a oneDNN linear over weights packed once."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout

    @classmethod
    def of(cls, module: torch.nn.Linear, pack_rows: int = 0) -> Linear:
        """pack_rows > 0: packs the weight for oneDNN, tuned for that many rows per call."""
        weight = module.weight.detach()
        bias = None if module.bias is None else module.bias.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, pack_rows) if pack_rows else None
        return cls(weight, bias, packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@dataclass(slots=True, frozen=True)
class RmsNorm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm.forward, op for op (the casts matter at bfloat16 and float16)
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


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

    def __init__(self, model, pack_rows: int = 0) -> None:
        """pack_rows > 0: projections through oneDNN packed weights (not exact; see the module docstring)."""
        decoder = model.model
        config = model.config
        self.head_dim = decoder.layers[0].self_attn.head_dim
        self.num_kv_heads = config.num_key_value_heads
        self.groups = config.num_attention_heads // self.num_kv_heads
        self.embedding = decoder.embed_tokens.weight.detach()
        self.rotary = decoder.rotary_emb  # the module itself: every RoPE type computes cos/sin as the model does
        self.final_norm = _norm(decoder.norm)
        self.lm_head = Linear.of(model.lm_head, pack_rows)
        self.layers = [_layer(layer, pack_rows) for layer in decoder.layers]
        self.packed = bool(pack_rows)

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
        for index, layer in enumerate(self.layers):
            attended = self._attention(layer, layer.input_norm(hidden), keys[index], values[index], rows, columns,
                                       length, mask, cos, sin)
            hidden = hidden + attended
            normed = layer.post_norm(hidden)
            hidden = hidden + layer.down(layer.act(layer.gate(normed)) * layer.up(normed))
        return self.lm_head(self.final_norm(hidden))[:, -1].float()

    def _attention(self, layer: LayerWeights, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   rows: torch.Tensor, columns: torch.Tensor, length: int, mask: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        query = layer.q(x).view(num_rows, 1, -1, self.head_dim).transpose(1, 2)  # [rows, heads, 1, head_dim]
        key = layer.k(x).view(num_rows, 1, -1, self.head_dim).transpose(1, 2)  # [rows, kv_heads, 1, head_dim]
        value = layer.v(x).view(num_rows, 1, -1, self.head_dim).transpose(1, 2)
        query = (query * cos) + (_rotate_half(query) * sin)
        key = (key * cos) + (_rotate_half(key) * sin)
        keys[rows, :, columns] = key[:, :, 0]  # keys: [rows, kv_heads, capacity, head_dim]
        values[rows, :, columns] = value[:, :, 0]
        if self.groups > 1:  # one query token: its heads' groups become the query length (transformers' pack_gqa)
            query = query.reshape(num_rows, self.num_kv_heads, self.groups, self.head_dim)
        output = F.scaled_dot_product_attention(query, keys[:, :, :length], values[:, :, :length], attn_mask=mask,
                                                dropout_p=0.0, scale=layer.scaling, is_causal=False)
        output = output.reshape(num_rows, -1, 1, self.head_dim).transpose(1, 2).contiguous()  # [rows, 1, heads, dim]
        return layer.o(output.reshape(num_rows, 1, -1).contiguous())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _norm(module) -> RmsNorm:
    return RmsNorm(module.weight.detach(), module.variance_epsilon)


def _layer(layer, pack_rows: int) -> LayerWeights:
    attention, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        input_norm=_norm(layer.input_layernorm),
        q=Linear.of(attention.q_proj, pack_rows), k=Linear.of(attention.k_proj, pack_rows),
        v=Linear.of(attention.v_proj, pack_rows), o=Linear.of(attention.o_proj, pack_rows),
        scaling=attention.scaling,
        post_norm=_norm(layer.post_attention_layernorm),
        gate=Linear.of(mlp.gate_proj, pack_rows), up=Linear.of(mlp.up_proj, pack_rows),
        down=Linear.of(mlp.down_proj, pack_rows),
        act=mlp.act_fn)
