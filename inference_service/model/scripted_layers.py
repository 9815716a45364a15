"""The decode step's layer loop, written once: the same ATen ops, in the same order, on the same tensors as
transformers' Llama/Mistral/Qwen2 decoder layers for one new token per row (so the same bits).

LeanStep (model/lean_step.py) runs it as TorchScript on a CPU, where the interpreter runs the ~40 ops of a layer
without Python between them (docs/performance.md), and as this Python function on a GPU, where CUDA graphs
(model/graph_step.py) capture it: TorchScript's GPU fuser would fuse the pointwise ops and round them apart.
The start-up probe (model/step_runner.py) checks whichever runs bitwise against the model's forward.
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # transformers' LlamaRMSNorm.forward, op for op (the casts matter at bfloat16 and float16; at float32 they
    # return x itself, so the loop skips their dispatch)
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if dtype != torch.float32:
        x = x.to(dtype)
    return weight * x


def project(x: Tensor, weight_t: Tensor, bias: Optional[Tensor]) -> Tensor:
    """F.linear(x, weight, bias) for x [rows, in] and weight_t = weight.t() (a view made once): the product
    aten::linear runs for the decoder's [rows, 1, in] input (mm, or addmm with a bias, over the flattened rows),
    without linear's and matmul's dispatch, the transpose and the reshapes around it, ~120 times a step."""
    if bias is None:
        return torch.mm(x, weight_t)
    return torch.addmm(bias, x, weight_t)


def signed_sin(sin: Tensor) -> Tensor:
    """sin with its first half negated: transformers' rotate_half(x) * sin ==
    roll(x, half) * signed_sin(sin), bitwise."""
    half = sin.size(-1) // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


# Columns per block of the invariant decode step's attention: a fixed split, so a row's reduction order never
# depends on how far the step's longest row reaches.
INVARIANT_ATTENTION_BLOCK = 256


def blockwise_attention(query: Tensor, keys: Tensor, values: Tensor, positions: Tensor, length: int, block: int,
                        end: int, scale: float) -> Tensor:
    """Attention of one query token per row whose result depends on the row's own inputs only: columns in blocks
    at fixed offsets [k*block, min((k+1)*block, end)), each block's products at a shape that neither the other rows
    nor `length` choose, combined one block after the other (online softmax, float32). A block wholly past a row's
    position adds exact zeros (its max is -inf, its weights exp(-inf) = 0, its values finite), so how far the
    step's longest row reaches changes nothing in a shorter one.

    query: [rows, kv_heads, groups, head_dim]; keys, values: [rows, kv_heads, >= end, head_dim], finite up to the
    last block `length` enters; positions: [rows], the last column each row may read. Returns query's shape."""
    num_rows, num_kv_heads, num_queries, head_dim = query.shape
    query = query.float()
    best = torch.full((num_rows, num_kv_heads, num_queries, 1), float("-inf"), device=query.device)
    total = torch.zeros((num_rows, num_kv_heads, num_queries, 1), device=query.device)
    output = torch.zeros((num_rows, num_kv_heads, num_queries, head_dim), device=query.device)
    limit = positions.view(num_rows, 1, 1, 1)
    for start in range(0, length, block):
        stop = min(start + block, end)
        scores = torch.matmul(query, keys[:, :, start:stop].float().transpose(-1, -2)) * scale  # [r, kvh, g, cols]
        hidden = torch.arange(start, stop, device=query.device).view(1, 1, 1, stop - start) > limit
        scores = scores.masked_fill(hidden, float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1, keepdim=True))  # finite from block 0 on: column 0 is read
        weights = torch.exp(scores - new_best)
        correction = torch.exp(best - new_best)
        total = total * correction + weights.sum(-1, keepdim=True)
        output = output * correction + torch.matmul(weights, values[:, :, start:stop].float())
        best = new_best
    return output / total


def decoder_layers(hidden: Tensor, keys: Tensor, values: Tensor, rows: Tensor, columns: Tensor, length: int,
                   mask: Tensor, cos: Tensor, sin: Tensor, weights: List[List[Tensor]],
                   biases: List[List[Optional[Tensor]]], norms: List[List[Tensor]], eps: List[List[float]],
                   scalings: List[float], head_dim: int, num_kv_heads: int, groups: int, positions: Tensor,
                   block: int) -> Tensor:
    """Each layer over one token per row; writes each row's K/V at its column and returns the hidden states.

    hidden: [rows, hidden]; keys, values: [layers, rows, kv_heads, capacity, head_dim]; rows, columns: [rows];
    mask: [rows, 1, 1, length], bool (True where a row may attend) or additive (0 / -inf); cos, sin: [rows, 1, 1,
    head_dim], sin with its first half negated (rotate_half's sign, moved onto sin: -(a*b) == (-a)*b == a*(-b) in
    IEEE arithmetic, so the products are the same bits). weights[i]: layer i's q, k, v, o, gate, up, down, or
    (joined, model/joined_weights.py) q|k|v, o, gate|up, down, each transposed ([in, out] views); biases[i]: theirs;
    norms[i], eps[i]: its input and post-attention norms. block > 0: attention is blockwise_attention in blocks of
    that many columns up to `length` (mask unused; positions [rows] instead), the invariant decode step's; 0:
    transformers' SDPA, bitwise the model's forward."""
    num_rows = hidden.size(0)
    num_heads = num_kv_heads * groups
    half = head_dim // 2  # rotate_half as one roll: the last dimension's halves swapped (the sign is in sin)
    # each row's new K/V lands at (row, head, column): one index_copy_ into a [rows * kv_heads * capacity,
    # head_dim] view of a layer's slots where they are laid out contiguously (the same bytes as indexing them)
    capacity = keys.size(3)
    flat = ((rows.view(-1, 1) * num_kv_heads + torch.arange(num_kv_heads, device=rows.device).view(1, -1))
            * capacity + columns.view(-1, 1)).view(-1)
    for index in range(len(weights)):
        weight, bias, norm, epsilon = weights[index], biases[index], norms[index], eps[index]
        fused = len(weight) == 4  # [q|k|v], o, [gate|up], down (fuse_projections), else the 7 separate ones
        x = rms_norm(hidden, norm[0], epsilon[0])
        if fused:
            # one product for q, k and v, one RoPE for q and k: per element the same ops as apart (a row's output
            # columns are reduced alike whatever the product's width: the start-up probe checks it bitwise)
            qkv = project(x, weight[0], bias[0]).view(num_rows, -1, 1, head_dim)
            rotated = qkv[:, : num_heads + num_kv_heads]  # [rows, heads + kv_heads, 1, head_dim]
            rotated = (rotated * cos) + (torch.roll(rotated, [half], [-1]) * sin)
            query, key = rotated[:, :num_heads], rotated[:, num_heads:]
            value = qkv[:, num_heads + num_kv_heads :]
        else:
            query = project(x, weight[0], bias[0]).view(num_rows, -1, 1, head_dim)
            key = project(x, weight[1], bias[1]).view(num_rows, -1, 1, head_dim)
            value = project(x, weight[2], bias[2]).view(num_rows, -1, 1, head_dim)
            query = (query * cos) + (torch.roll(query, [half], [-1]) * sin)
            key = (key * cos) + (torch.roll(key, [half], [-1]) * sin)
        layer_keys, layer_values = keys[index], values[index]  # [rows, kv_heads, capacity, head_dim]
        if layer_keys.is_contiguous() and layer_values.is_contiguous():
            layer_keys.view(-1, head_dim).index_copy_(0, flat, key.reshape(-1, head_dim))
            layer_values.view(-1, head_dim).index_copy_(0, flat, value.reshape(-1, head_dim))
        else:
            layer_keys[rows, :, columns] = key[:, :, 0]
            layer_values[rows, :, columns] = value[:, :, 0]
        if groups > 1:  # one query token: its heads' groups become the query length (transformers' pack_gqa)
            query = query.reshape(num_rows, num_kv_heads, groups, head_dim)
        if block > 0:
            output = blockwise_attention(query, layer_keys, layer_values, positions, length, block,
                                         layer_keys.size(2) - 1, scalings[index]).to(hidden.dtype)
        else:
            output = F.scaled_dot_product_attention(query, layer_keys[:, :, :length], layer_values[:, :, :length],
                                                    attn_mask=mask, dropout_p=0.0, is_causal=False,
                                                    scale=scalings[index])
        # one query token: [rows, heads, 1, head_dim] and [rows, 1, heads * head_dim] hold the same elements in
        # the same order (reshape copies only where SDPA's output is laid out otherwise)
        out, down = (1, 3) if fused else (3, 6)
        hidden = hidden + project(output.reshape(num_rows, -1), weight[out], bias[out])
        x = rms_norm(hidden, norm[1], epsilon[1])
        if fused:
            gate_up = project(x, weight[2], bias[2])  # [rows, 2 * intermediate]
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate = project(x, weight[4], bias[4])
            up = project(x, weight[5], bias[5])
        hidden = hidden + project(F.silu(gate) * up, weight[down], bias[down])
    return hidden


# TorchScript is deprecated in torch 2.x; torch is pinned, and tests/inference_service/model/test_lean_step.py
# fails loudly if a later torch changes what the scripted loop returns.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
    scripted_decoder_layers = torch.jit.script(decoder_layers)
