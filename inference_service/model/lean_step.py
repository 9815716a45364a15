"""A decode step written over the HF module's own weights: the same ATen ops as transformers' forward, no plumbing.

For one new token per row, transformers' Llama/Mistral/Qwen2 decoder runs, per layer: RMSNorm, the q/k/v
projections, RoPE, the cache write, SDPA (query groups folded into the batch: `pack_gqa`), the output
projection, RMSNorm and the gated MLP. LeanStep runs the embedding and RoPE tables as the model does, the layers
through the one layer loop (model/scripted_layers.py), then the final norm and the head, so at any dtype its
logits are bitwise the model's own (the start-up probe in model/step_runner.py checks it); what it leaves out is the
per-call machinery around those ops (output dataclasses, Cache objects, mask preprocessing, kwargs merging, hooks).
On a CPU it first places the weights it reads in huge pages, runs q/k/v and gate/up as one product each
(model/joined_weights.py), and makes the mask additive once per step instead of in each layer's SDPA: the same bits,
fewer ops (the probe checks that too).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_service.model.batch_forward import has_sliding_layers
from inference_service.model.joined_weights import fused_projections, place_weights
from inference_service.model.scripted_layers import decoder_layers, rms_norm, scripted_decoder_layers, signed_sin

LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})  # decoders whose forward LeanStep repeats op for op
SDPA_IMPLEMENTATIONS = frozenset({"sdpa", "kvboost_sdpa"})  # kvboost_sdpa runs transformers' SDPA for one query
_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lean_step_support(model) -> str:
    """Why LeanStep cannot stand in for this model's decode forward; '' when it can (then the probe verifies)."""
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
        if not all(isinstance(_projection(layer, name), torch.nn.Linear) for name in _PROJECTIONS):
            return "projections that are not separate linear layers (q/k/v/o, gate/up/down)"
        if type(layer.input_layernorm).__name__ not in _RMS_NORMS or type(layer.post_attention_layernorm).__name__ not in _RMS_NORMS:
            return f"normalization {type(layer.input_layernorm).__name__} is not the Llama RMSNorm"
        if not _plain_silu(mlp.act_fn):
            return f"activation {type(mlp.act_fn).__name__} is not SiLU (the layer loop gates with F.silu)"
    return ""


def _projection(layer, name: str):
    return getattr(layer.self_attn if name in _PROJECTIONS[:4] else layer.mlp, name, None)


def _plain_silu(act: torch.nn.Module) -> bool:
    """F.silu and nothing else: torch's SiLU, or transformers' SiLUActivation with its own forward (not a kernel
    from the Hub swapped in)."""
    if type(act) is torch.nn.SiLU:
        return True
    return type(act).__name__ == "SiLUActivation" and getattr(type(act).forward, "__qualname__", "") == \
        "SiLUActivation.forward" and "forward" not in vars(act)


class LeanStep:
    """One token for each of a step's rows, over the K/V owner's slots (lean_step_support must hold).

    fused: the layer loop runs one product for q, k and v and one for gate and up (fused_projections) where every
    layer allows it; the default on a CPU, where MKL reduces each output column alike whatever the product's width
    (choose_runner's probe checks it, and builds the step unfused where it does not hold)."""

    def __init__(self, model, fused: bool | None = None) -> None:
        decoder = model.model
        if decoder.embed_tokens.weight.device.type == "cpu":
            place_weights(model)  # every weight the step reads, in huge pages (model/joined_weights.py); once
        config = model.config
        self.head_dim = decoder.layers[0].self_attn.head_dim
        self.num_kv_heads = config.num_key_value_heads
        self.groups = config.num_attention_heads // self.num_kv_heads
        self.embedding = decoder.embed_tokens.weight.detach()
        self.rotary = decoder.rotary_emb  # the module itself: every RoPE type computes cos/sin as the model does
        self.final_norm = (decoder.norm.weight.detach(), float(decoder.norm.variance_epsilon))
        self.lm_head = (model.lm_head.weight.detach(),
                        None if model.lm_head.bias is None else model.lm_head.bias.detach())
        layers = decoder.layers
        linears = [[_projection(layer, name) for name in _PROJECTIONS] for layer in layers]
        self.weights = [[linear.weight.detach() for linear in row] for row in linears]
        self.biases = [[None if linear.bias is None else linear.bias.detach() for linear in row] for row in linears]
        self.norms = [[layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
                      for layer in layers]
        self.eps = [[float(layer.input_layernorm.variance_epsilon), float(layer.post_attention_layernorm.variance_epsilon)]
                    for layer in layers]
        self.scalings = [float(layer.self_attn.scaling) for layer in layers]
        # TorchScript on a CPU; the Python function elsewhere (a GPU captures it in graphs, and TorchScript's GPU
        # fuser would round the pointwise ops apart), and on a CPU where TorchScript could fuse, which the pinned
        # torch does not: checked, not assumed.
        on_cpu = self.embedding.device.type == "cpu" and not torch._C._jit_can_fuse_on_cpu()
        self.layers = scripted_decoder_layers if on_cpu else decoder_layers
        self.scripted = on_cpu
        # a GPU's products pick kernels by shape (a wider one may split its reduction otherwise): fused on a CPU only
        fused = self.embedding.device.type == "cpu" if fused is None else fused
        layout = fused_projections(layers) if fused else None
        self.fused = layout is not None
        if layout is not None:
            self.weights, self.biases = layout
        # what the layer loop multiplies by: each weight transposed, once (views: no bytes copied)
        self.weights_t = [[weight.t() for weight in row] for row in self.weights]
        # > 0: attention in blocks of this many columns whose result depends on the row alone (the invariant decode
        # step: model/step_runner.py pads its rows to every slot); 0: SDPA, bitwise the model's forward.
        self.attention_block = 0

    @torch.inference_mode()
    def __call__(self, keys: torch.Tensor, values: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                 columns: torch.Tensor, length: int, mask: torch.Tensor) -> torch.Tensor:
        """Writes each row's new K/V at its column and returns logits [rows, vocab] (float32).

        keys, values: [layers, rows, kv_heads, capacity, head_dim] (the step's slots); token_ids: [rows, 1];
        positions, columns: [rows]; mask: bool [rows, 1, 1, length], True where a row may attend.
        """
        num_rows = token_ids.shape[0]
        rows = torch.arange(num_rows, device=token_ids.device)
        if self.scripted and self.attention_block == 0:
            # SDPA turns a boolean mask into this one in each layer: once per step here, the same values
            mask = torch.zeros(mask.shape, dtype=self.embedding.dtype).masked_fill_(mask.logical_not(), float("-inf"))
        embedded = F.embedding(token_ids, self.embedding)  # [rows, 1, hidden]
        cos, sin = self.rotary(embedded, positions.view(num_rows, 1))  # [rows, 1, head_dim]
        cos, sin = cos.unsqueeze(1), signed_sin(sin.unsqueeze(1))  # [rows, 1, 1, head_dim], over the heads
        hidden = self.layers(embedded.view(num_rows, -1), keys, values, rows, columns, length, mask, cos, sin,
                             self.weights_t, self.biases, self.norms, self.eps, self.scalings, self.head_dim,
                             self.num_kv_heads, self.groups, positions, self.attention_block)  # [rows, hidden]
        hidden = rms_norm(hidden, *self.final_norm)
        return F.linear(hidden, *self.lm_head).float()
