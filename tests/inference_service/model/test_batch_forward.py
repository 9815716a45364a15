"""prefill_rows with a kept workspace: the same logits and K/V, bit for bit, as with buffers of its own, whatever
an earlier (larger, different) batch left in the workspace; batches over the workspace's budget are not kept."""
from __future__ import annotations

import torch

from inference_service.model.batch_forward import BatchWorkspace, PrefillRow, prefill_rows
from inference_service.kv_memory.kv_buffers import kv_geometry


def make_rows(model, cached: list[int], new: list[int], seed: int) -> list[PrefillRow]:
    geometry = kv_geometry(model.config)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for num_cached, num_new in zip(cached, new):
        shape = (geometry.num_layers, geometry.num_kv_heads, num_cached + num_new + 4, geometry.head_dim)
        keys = torch.randn(shape, generator=generator) * 0.5
        values = torch.randn(shape, generator=generator) * 0.5
        tokens = torch.randint(3, 200, (num_new,), generator=generator).tolist()
        rows.append(PrefillRow(keys, values, num_cached, tokens))
    return rows


def copies(rows: list[PrefillRow]) -> list[PrefillRow]:
    return [PrefillRow(row.keys.clone(), row.values.clone(), row.start, list(row.token_ids)) for row in rows]


def test_a_reused_workspace_gives_the_bits_of_fresh_buffers(tiny_llama):
    model, _ = tiny_llama
    workspace = BatchWorkspace()
    larger = make_rows(model, [60, 9, 25, 31, 5], [7, 12, 3, 5, 9], seed=1)  # wider and taller than every case
    prefill_rows(model, larger, workspace=workspace)
    with torch.inference_mode():  # whatever was left: it must never be read
        workspace._storage[0].fill_(float("nan"))
        workspace._storage[1].fill_(float("inf"))
    for cached, new, seed in (([20, 3], [4, 9], 2), ([0, 17, 8], [5, 5, 1], 3), ([33, 33, 2, 50], [2, 8, 6, 3], 4)):
        rows = make_rows(model, cached, new, seed)
        fresh, kept = copies(rows), copies(rows)
        expected = prefill_rows(model, fresh)
        storage = workspace._storage[0].data_ptr()
        got = prefill_rows(model, kept, workspace=workspace)
        assert workspace._storage[0].data_ptr() == storage  # the NaN-filled buffers were the ones used
        assert torch.equal(expected, got)
        for one, other in zip(fresh, kept):
            assert torch.equal(one.keys, other.keys) and torch.equal(one.values, other.values)


def test_a_batch_over_the_budget_gets_buffers_of_its_own():
    workspace = BatchWorkspace(max_bytes=1000)
    keys, values = workspace.take((2, 3, 50), torch.float32, torch.device("cpu"))  # 2 x 1200 bytes
    assert keys.shape == values.shape == (2, 3, 50) and workspace._storage is None
    keys, values = workspace.take((2, 3, 10), torch.float32, torch.device("cpu"))  # 2 x 240 bytes: kept
    assert workspace._storage is not None and keys.data_ptr() == workspace._storage[0].data_ptr()
    again, _ = workspace.take((3, 10), torch.float32, torch.device("cpu"))  # smaller: the same memory
    assert again.data_ptr() == keys.data_ptr()
    workspace.take((2, 3, 50), torch.float32, torch.device("cpu"))  # over the budget: the kept ones are let go
    assert workspace._storage is None
    assert BatchWorkspace.for_device(torch.device("cpu")) is not None
    assert BatchWorkspace.for_device(torch.device("meta")) is None
