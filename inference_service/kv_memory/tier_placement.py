"""Places a run of chunks L0 (or the host tier) holds into a request's slot: one lock for the run, a few batched
copies, not two per chunk."""
from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import pairwise

import torch

from inference_service.kv_memory.host_tier import HostTier
from inference_service.kv_memory.l0_tier import KV, L0Tier
from inference_service.kv_memory.tier_rates import TierLoad
from kvboost_keys.chunking import Chunk

# On CUDA a group of chunks is gathered into one contiguous temporary before its one strided copy into the slot: the
# temporary's size is bounded by this (per tensor), so a 32k-token prompt's placement needs no second copy of it.
PLACEMENT_GROUP_BYTES = 512 << 20


def place_from_l0(l0: L0Tier | None, chunks: Sequence[Chunk], keys: Sequence[bytes],
                   buffers: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Copies the leading chunks of a contiguous run that L0 holds (with their lengths) into their slices of the
    buffers (keys, values [layers, kv_heads, capacity, head_dim]); returns how many."""
    if l0 is None or not chunks:
        return 0
    assert all(before.end == after.start for before, after in pairwise(chunks)), "a run of adjacent chunks"
    taken = l0.take_run(keys, [len(chunk.token_ids) for chunk in chunks])
    if taken:
        copy_run_(taken, chunks[0].start, buffers)
    return len(taken)


def tiers_holding(l0: L0Tier | None, host: HostTier | None, chunks: Sequence[Chunk],
                  keys: Sequence[bytes]) -> list[str]:
    """The tier ("l0" or "host") each leading chunk would be placed from, up to the first neither holds, as
    place_from_tiers would take them (L0 first); counts no hit (they may change before they are placed)."""
    tiers: list[str] = []
    for chunk, key in zip(chunks, keys):
        if l0 is not None and l0.holds(key, len(chunk.token_ids)):
            tiers.append("l0")
        elif host is not None and key in host and len(chunk.token_ids) == host.slab_shape[2]:
            tiers.append("host")
        else:
            break
    return tiers


def place_from_tiers(l0: L0Tier | None, host: HostTier | None, chunks: Sequence[Chunk], keys: Sequence[bytes],
                     buffers: tuple[torch.Tensor, torch.Tensor], bytes_per_token: int) -> tuple[int, list[TierLoad]]:
    """Copies the leading chunks of a contiguous run that the service's tiers hold, each from L0 when it has it,
    else from the host tier (whole chunks only), into their slices of the buffers; returns (how many, what each
    tier placed). L0 evicts a prefix's last chunks first, into the host tier, so a long prompt's head usually comes
    from L0 and the rest from the host tier; the loop takes any interleaving."""
    placed = 0
    totals = {"l0": [0, 0, 0.0], "host": [0, 0, 0.0]}  # tier -> chunks, tokens, seconds
    spans: dict[str, list] = {}  # tier -> [event before its first copy, event after its last] (CUDA)
    progress = True
    while progress and placed < len(chunks):
        progress = False
        for tier in ("l0", "host"):
            if placed == len(chunks):
                break
            started = time.perf_counter()
            before = device_mark(buffers)
            if tier == "l0":
                count = place_from_l0(l0, chunks[placed:], keys[placed:], buffers)
            else:
                count = 0 if host is None else host.place_run(keys[placed:], chunks[placed].start, buffers)
            if count:
                total = totals[tier]
                total[0] += count
                total[1] += sum(len(chunk.token_ids) for chunk in chunks[placed : placed + count])
                total[2] += time.perf_counter() - started
                if before is not None:
                    spans.setdefault(tier, [before, None])[1] = device_mark(buffers)
                placed += count
                progress = True
    loads = [TierLoad(tier, chunks_, tokens * bytes_per_token, seconds, tuple(spans[tier]) if tier in spans else None)
             for tier, (chunks_, tokens, seconds) in totals.items() if chunks_]
    return placed, loads


def device_mark(buffers: tuple[torch.Tensor, torch.Tensor]) -> torch.cuda.Event | None:
    """On CUDA, a timing event recorded now on the current stream (what a TierLoad's copy_span holds); else None."""
    if buffers[0].device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def copy_run_(entries: Sequence[KV], start: int, buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Writes the entries' keys and values ([layers, kv_heads, n_i, head_dim] each) one after another into the
    buffers from position `start`: the same bytes per-chunk copies would write.

    On a CPU one concatenation writes straight into the slot's slice of each buffer. On CUDA a concatenation whose
    output is a strided slice of a large buffer falls back to one copy per input, so each group of chunks is
    concatenated into a contiguous temporary (batched launches) and copied into the slice once.
    """
    for index, buffer in enumerate(buffers):
        parts = [entry[index] for entry in entries]
        if buffer.device.type != "cuda":
            end = start + sum(part.shape[2] for part in parts)
            _concatenate_into(parts, buffer[:, :, start:end])
            continue
        position = start
        for group in _groups(parts, PLACEMENT_GROUP_BYTES):
            length = sum(part.shape[2] for part in group)
            buffer[:, :, position : position + length].copy_(group[0] if len(group) == 1 else torch.cat(group, dim=2))
            position += length


def _concatenate_into(parts: Sequence[torch.Tensor], target: torch.Tensor) -> None:
    if len(parts) == 1:
        target.copy_(parts[0])
    else:
        torch.cat(list(parts), dim=2, out=target)


def _groups(parts: Sequence[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive parts in groups of at most max_bytes (a larger part goes alone)."""
    groups: list[list[torch.Tensor]] = []
    group_bytes = 0
    for part in parts:
        size = part.numel() * part.element_size()
        if groups and group_bytes + size <= max_bytes:
            groups[-1].append(part)
            group_bytes += size
        else:
            groups.append([part])
            group_bytes = size
    return groups
