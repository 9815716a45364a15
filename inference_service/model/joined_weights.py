"""The lean step's fused layout: each layer's q|k|v and gate|up weights joined into one matrix, in file-backed pages.

One product for q, k and v (and one for gate and up) is three (two) fewer ops and OpenMP regions per layer, and
MKL reduces each output column of a product alike whatever its width (the start-up probe checks it bitwise). The
joined matrices live in one mapped temporary file, not in anonymous memory: the kernel keeps a file's pages in
physically contiguous runs, which the CPU's TLB covers with fewer entries, and a one-row product reads weights at
the rate their pages allow (docs/performance.md, "Joined weights"). The model's own linears are re-pointed to views
of the joined matrices, so the weights are held once.
"""
from __future__ import annotations

import logging
import mmap
import tempfile

import torch

logger = logging.getLogger(__name__)

_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
_ALIGN = 64  # bytes: each joined tensor starts on a cache line of the file


def fused_projections(layers) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor | None]]] | None:
    """Each layer's weights and biases as [q|k|v], o, [gate|up], down; None where a layer's q/k/v or gate/up biases
    are not all present or all absent. The first call joins them (re-pointing the model's linears to views); a
    later call on the same model finds them joined and returns views of the same memory."""
    groups = [[[getattr(getattr(layer, room), name) for name in names] for room, names in _GROUPS] for layer in layers]
    if any(len({linear.bias is None for linear in linears}) > 1 for layer in groups for linears in layer):
        return None
    parts = [[[getattr(linear, kind) for linear in linears] for linears in layer for kind in ("weight", "bias")
              if getattr(linears[0], kind) is not None] for layer in groups]
    if not all(_adjacent(tensors) for layer in parts for tensors in layer):
        _join([tensors for layer in parts for tensors in layer],
              [(linears, kind) for layer in groups for linears in layer for kind in ("weight", "bias")
               if getattr(linears[0], kind) is not None])
    weights, biases = [], []
    for layer, (qkv, gate_up) in zip(layers, groups):
        joined = [[_joined_view([getattr(linear, kind) for linear in linears]) if getattr(linears[0], kind) is not None
                   else None for linears in (qkv, gate_up)] for kind in ("weight", "bias")]
        out, down = layer.self_attn.o_proj, layer.mlp.down_proj
        weights.append([joined[0][0], out.weight.detach(), joined[0][1], down.weight.detach()])
        biases.append([joined[1][0], _detached(out.bias), joined[1][1], _detached(down.bias)])
    return weights, biases


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


def _join(groups: list[list[torch.Tensor]], owners: list[tuple[list, str]]) -> None:
    """Writes each group of tensors, joined, into one temporary file, maps it, and points each owner's linears
    (owners[i]: (linears, 'weight' or 'bias') of groups[i]) at views of the mapping. Anonymous memory where no
    temporary file can be written."""
    sizes = [sum(tensor.numel() * tensor.element_size() for tensor in group) for group in groups]
    starts = [sum(-(-size // _ALIGN) * _ALIGN for size in sizes[:index]) for index in range(len(sizes))]
    try:
        memory = _file_backed(groups, starts, starts[-1] + sizes[-1])
    except OSError as error:
        logger.info("joined decode weights in anonymous memory (no temporary file: %s)", error)
        memory = None
    for group, start, size, (linears, kind) in zip(groups, starts, sizes, owners):
        if memory is None:
            joined = torch.cat([tensor.detach() for tensor in group])
        else:
            first = group[0]
            joined = memory[start : start + size].view(first.dtype).view(-1, *first.shape[1:])
        row = 0
        for linear, tensor in zip(linears, group):
            view = joined[row : row + tensor.shape[0]]
            setattr(linear, kind, torch.nn.Parameter(view, requires_grad=tensor.requires_grad))
            row += tensor.shape[0]


def _file_backed(groups: list[list[torch.Tensor]], starts: list[int], total: int) -> torch.Tensor:
    """A uint8 tensor of `total` bytes over a private mapping of an unlinked temporary file holding each group
    joined at its start (the file is written, then mapped: written pages are the page cache's)."""
    with tempfile.TemporaryFile(prefix="kvboost-joined-") as file:
        for group, start in zip(groups, starts):
            file.seek(start)
            for tensor in group:
                file.write(tensor.detach().contiguous().view(torch.uint8).view(-1).numpy().data)
        file.truncate(max(total, 1))
        file.flush()
        mapping = mmap.mmap(file.fileno(), total, access=mmap.ACCESS_COPY)  # writes (none) stay private
    return torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor holds the mapping; the file is unlinked
