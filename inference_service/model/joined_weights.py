"""The decode weights in one huge-page arena: every weight the lean step reads, with each layer's q|k|v and gate|up
joined into one matrix, copied into one anonymous mapping that asks the kernel for transparent huge pages.

A one-row decode step streams all of the model's weights once per token, and on a CPU its speed is the rate those
reads reach. Read through 4 KiB pages, every 4 KiB costs a TLB entry, and how much the page walks cost depends on the
host: on this machine the same 538 MB of one-row products took 25 ms from 2 MiB pages and 35-77 ms from 4 KiB ones
(a safetensors file's page cache or a plain copy), run after run (docs/performance.md, "Decode weights in huge
pages"). So the lean step places them once, at start-up: a private anonymous mapping, `madvise(MADV_HUGEPAGE)`
before the first write (the kernel's `transparent_hugepage` setting is `madvise` or `always` on most hosts; under
`never` the arena is ordinary memory and nothing else changes). The model's own parameters are re-pointed to views
of the arena, so the weights are held once and the prefill forward reads the same bytes.

Joined, one product for q, k and v (and one for gate and up) is three (two) fewer ops and OpenMP regions per layer,
and MKL reduces each output column of a product alike whatever its width (the start-up probe checks it bitwise).
"""
from __future__ import annotations

import logging
import mmap
import weakref

import torch

logger = logging.getLogger(__name__)

_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
_SINGLES = (("self_attn", "o_proj"), ("mlp", "down_proj"))
_ALIGN = 64  # bytes: each placed tensor starts on a cache line, as torch's own allocator places them
_PLACED: weakref.WeakSet = weakref.WeakSet()  # models placed (not an attribute: a deepcopy's weights are not)


def fused_projections(layers) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor | None]]] | None:
    """Each layer's weights and biases as [q|k|v], o, [gate|up], down; None where a layer's q/k/v or gate/up biases
    are not all present or all absent. Where the model's weights are not placed yet (place_weights), the q|k|v
    and gate|up groups are joined into an arena of their own; a later call finds them joined and returns views."""
    groups = [[[getattr(getattr(layer, room), name) for name in names] for room, names in _GROUPS] for layer in layers]
    if any(len({linear.bias is None for linear in linears}) > 1 for layer in groups for linears in layer):
        return None
    blocks = [[(linear, kind) for linear in linears] for layer in groups for linears in layer
              for kind in ("weight", "bias") if getattr(linears[0], kind) is not None]
    if not all(_adjacent([getattr(owner, kind) for owner, kind in block]) for block in blocks):
        _place(blocks)
    weights, biases = [], []
    for layer, (qkv, gate_up) in zip(layers, groups):
        joined = [[_joined_view([getattr(linear, kind) for linear in linears]) if getattr(linears[0], kind) is not None
                   else None for linears in (qkv, gate_up)] for kind in ("weight", "bias")]
        out, down = layer.self_attn.o_proj, layer.mlp.down_proj
        weights.append([joined[0][0], out.weight.detach(), joined[0][1], down.weight.detach()])
        biases.append([joined[1][0], _detached(out.bias), joined[1][1], _detached(down.bias)])
    return weights, biases


def place_weights(model) -> bool:
    """Copies every weight a Llama-layout decoder's step reads into one huge-page arena and re-points the model's
    parameters to views of it (tied parameters stay tied): per layer q|k|v (joined where their biases allow),
    o, gate|up, down and both norms, then the final norm, the embedding and the head. Returns False where the
    model was placed already (placing twice would only copy again)."""
    if model in _PLACED:
        return False
    decoder = model.model
    blocks: list[list[tuple[torch.nn.Module, str]]] = []
    for layer in decoder.layers:
        for room, names in _GROUPS:
            linears = [getattr(getattr(layer, room), name) for name in names]
            for kind in ("weight", "bias"):
                present = [linear for linear in linears if getattr(linear, kind) is not None]
                if len(present) == len(linears):
                    blocks.append([(linear, kind) for linear in linears])  # adjacent: fused_projections joins
                else:
                    blocks.extend([(linear, kind)] for linear in present)
        for room, name in _SINGLES:
            linear = getattr(getattr(layer, room), name)
            blocks.extend([(linear, kind)] for kind in ("weight", "bias") if getattr(linear, kind) is not None)
        blocks.extend([(norm, "weight")] for norm in (layer.input_layernorm, layer.post_attention_layernorm))
    blocks.append([(decoder.norm, "weight")])
    blocks.append([(decoder.embed_tokens, "weight")])
    head = getattr(model, "lm_head", None)
    if head is not None and head.weight is not decoder.embed_tokens.weight:
        blocks.append([(head, "weight")])
        if head.bias is not None:
            blocks.append([(head, "bias")])
    _place(blocks, ties=_owners(model))
    _PLACED.add(model)
    return True


def _owners(model) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """Each parameter (by identity) with every (module, name) that holds it: a tied head and embedding are one."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None:
                owners.setdefault(id(parameter), []).append((module, name))
    return owners


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def _adjacent(tensors: list[torch.Tensor]) -> bool:
    """The tensors lie one after the other in one storage, as views of one joined tensor do."""
    first, end = tensors[0], tensors[0].data_ptr()
    for tensor in tensors:
        if not tensor.is_contiguous() or tensor.data_ptr() != end or tensor.shape[1:] != first.shape[1:] \
                or tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return False
        end += tensor.numel() * tensor.element_size()
    return True


def _joined_view(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The adjacent tensors as one: [sum of their rows, *their other dims]."""
    first = tensors[0].detach()
    return first.as_strided((sum(tensor.shape[0] for tensor in tensors), *first.shape[1:]), first.stride())


def _place(blocks: list[list[tuple[torch.nn.Module, str]]],
           ties: dict[int, list[tuple[torch.nn.Module, str]]] | None = None) -> None:
    """Copies each block's tensors one after the other into one arena (a block's tensors adjacent, each block on a
    cache line) and points every holder of each tensor at its view: the block's own (module, name) pairs, and
    through `ties` every other module holding the same parameter."""
    tensors = [[getattr(owner, kind) for owner, kind in block] for block in blocks]
    sizes = [sum(tensor.numel() * tensor.element_size() for tensor in block) for block in tensors]
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    arena = _huge_page_arena(max(total, 1))
    for block, group, start in zip(blocks, tensors, starts):
        offset = start
        for (owner, kind), tensor in zip(block, group):
            size = tensor.numel() * tensor.element_size()
            view = arena[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            holders = (ties or {}).get(id(tensor), [(owner, kind)])
            parameter = torch.nn.Parameter(view, requires_grad=tensor.requires_grad)
            for module, name in holders:
                setattr(module, name, parameter)
            offset += size


def _huge_page_arena(size: int) -> torch.Tensor:
    """A uint8 tensor over `size` bytes of private anonymous memory that asked for transparent huge pages before
    any page was touched; ordinary memory where the platform has no such mapping."""
    try:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, OSError, ValueError) as error:  # no anonymous private mappings here
        logger.info("decode weights in the allocator's memory (no anonymous mapping: %s)", error)
        return torch.empty(size, dtype=torch.uint8)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as error:  # no MADV_HUGEPAGE on this platform or kernel: 4 KiB pages
        logger.info("decode weights without huge pages (madvise: %s)", error)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
