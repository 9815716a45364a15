"""The batched load path (kv.loader through reuse.assembler.fetch_prefix_run): 16-bit blobs copied byte for byte into
the slot, on a GPU through pinned staging and asynchronous copies; checksums and NaN checks for the whole run, a bad
chunk ending the run where the per-chunk path would; every other blob still decoded and rotated."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_service.kv import loader
from inference_service.kv.codec import HEADER_SIZE, encode_chunk
from inference_service.reuse.assembler import fetch_prefix_run
from inference_service.store.memory import InMemoryStore
from inference_service.store.protocol import StoreItem
from kvboost_keys.namespace import Namespace
from kvboost_keys.prompts import plan_prompt

NAMESPACE = Namespace(bytes(32))
CHUNK = 8
LAYERS, HEADS, DIM = 3, 2, 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def computed_kv(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for a prefill's K/V [layers, kv_heads, tokens, head_dim]."""
    generator = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, num_tokens, DIM)
    return (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))


def stored_run(num_chunks: int, dtype: torch.dtype, bits: dict[int, int] | None = None):
    """A prompt of num_chunks whole chunks whose blobs are all stored; bits: a chunk index's storage width."""
    plan = plan_prompt(NAMESPACE, [list(range(1000, 1000 + num_chunks * CHUNK))], CHUNK)
    keys, values = computed_kv(num_chunks * CHUNK, dtype)
    store = InMemoryStore()
    items = []
    for index, (chunk, key) in enumerate(zip(plan.chunks.chunks, plan.prefix_keys)):
        span = slice(chunk.start, chunk.end)
        blob = encode_chunk(keys[:, :, span], values[:, :, span], chunk.start, bits=(bits or {}).get(index, 16),
                            group_size=8)
        items.append(StoreItem(key, b"ns", None, CHUNK, blob))
    store.store(items)
    return plan, store, keys, values


def slot(dtype: torch.dtype, device: str, capacity: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYERS, HEADS, capacity, DIM)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


class Reported(InMemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.corrupt: list[bytes] = []

    def report_corrupt(self, keys: list[bytes]) -> None:
        self.corrupt += keys


def corrupt_store(store: InMemoryStore, plan, index: int, how: str) -> Reported:
    """A copy of store whose chunk `index` fails its checksum ("crc") or holds NaN under a valid one ("nan")."""
    reported = Reported()
    reported._entries = dict(store._entries)
    key = plan.prefix_keys[index]
    entry = reported._entries[key]
    blob = bytearray(entry.blob)
    if how == "crc":
        blob[HEADER_SIZE + 5] ^= 0xFF
    else:
        chunk = plan.chunks.chunks[index]
        keys, values = computed_kv(len(plan.token_ids), torch.bfloat16)
        keys[1, 0, chunk.start + 2, 3] = float("nan")
        span = slice(chunk.start, chunk.end)
        blob = bytearray(encode_chunk(keys[:, :, span], values[:, :, span], chunk.start))
    reported._entries[key] = dataclasses.replace(entry, blob=blob)
    return reported


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_run_lands_byte_for_byte(device, dtype):
    num_chunks = loader.STAGING_BUFFERS * 2 + 3  # around the staging ring twice
    plan, store, keys, values = stored_run(num_chunks, dtype)
    buffers = slot(dtype, device)
    context = fetch_prefix_run(store, plan, num_chunks, buffers)
    end = num_chunks * CHUNK
    assert (context.num_cached_chunks, context.num_cached_tokens) == (num_chunks, end)
    assert torch.equal(buffers[0][:, :, :end].cpu(), keys) and torch.equal(buffers[1][:, :, :end].cpu(), values)
    assert not buffers[0][:, :, end:].any(), "nothing written past the run"
    assert context.num_bytes_fetched == sum(len(blob) for _, blob in store.fetch(list(plan.prefix_keys)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["crc", "nan"])
@pytest.mark.parametrize("bad", [0, 5, 11])
def test_a_bad_chunk_ends_the_run_there_and_is_reported(device, how, bad):
    plan, store, keys, values = stored_run(12, torch.bfloat16)
    store = corrupt_store(store, plan, bad, how)
    buffers = slot(torch.bfloat16, device)
    context = fetch_prefix_run(store, plan, 12, buffers)
    assert context.num_cached_chunks == bad
    assert context.num_cached_tokens == bad * CHUNK
    assert store.corrupt == [plan.prefix_keys[bad]]
    if bad:
        assert torch.equal(buffers[0][:, :, : bad * CHUNK].cpu(), keys[:, :, : bad * CHUNK])
        assert context.num_bytes_fetched == sum(len(blob) for _, blob in store.fetch(list(plan.prefix_keys[:bad])))
    else:
        assert context.key_buffer is None, "nothing placed: no context"


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_blobs_in_the_run_are_still_decoded(device):
    plan, store, keys, values = stored_run(6, torch.float32, bits={2: 8, 3: 4})
    buffers = slot(torch.float32, device)
    context = fetch_prefix_run(store, plan, 6, buffers)
    assert context.num_cached_chunks == 6
    raw = [0, 1, 4, 5]
    for index in raw:
        span = slice(index * CHUNK, (index + 1) * CHUNK)
        assert torch.equal(buffers[0][:, :, span].cpu(), keys[:, :, span])
    quantized = slice(2 * CHUNK, 4 * CHUNK)
    torch.testing.assert_close(buffers[1][:, :, quantized].cpu(), values[:, :, quantized], atol=0.5, rtol=0.1)
    assert not torch.equal(buffers[1][:, :, quantized].cpu(), values[:, :, quantized]), "8 and 4 bits round"


def test_only_what_the_slot_needs_byte_for_byte_is_copied_raw():
    buffers = slot(torch.bfloat16, "cpu")
    keys, values = computed_kv(CHUNK, torch.bfloat16)
    from inference_service.kv.codec import read_header
    assert loader.copies_raw(read_header(encode_chunk(keys, values, 16)), 16, CHUNK, buffers)
    assert not loader.copies_raw(read_header(encode_chunk(keys, values, 8)), 16, CHUNK, buffers), "another position"
    assert not loader.copies_raw(read_header(encode_chunk(keys.float(), values.float(), 16)), 16, CHUNK, buffers)
    assert not loader.copies_raw(read_header(encode_chunk(keys, values, 16, bits=8)), 16, CHUNK, buffers)
    assert not loader.copies_raw(read_header(encode_chunk(keys, values, 16)), 16, CHUNK - 1, buffers), "longer"


@pytest.mark.gpu
def test_the_staging_ring_stays_bounded_on_a_gpu():
    plan, store, _, _ = stored_run(40, torch.bfloat16)
    ring = loader.staging_ring()
    fetch_prefix_run(store, plan, 40, slot(torch.bfloat16, "cuda", capacity=40 * CHUNK))
    blob_bytes = max(len(blob) for _, blob in store.fetch(list(plan.prefix_keys)))
    assert 0 < ring.bytes_pinned <= loader.STAGING_BUFFERS * max(blob_bytes, 1 << 20)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("bad", [None, 0, 9])
def test_the_staged_pipeline_places_and_checks_as_the_direct_copy(verify, bad):
    """The GPU's pipeline (staging on the pool, copies queued in order) run over plain memory on the CPU."""
    from inference_service.kv.codec import read_header

    plan, store, keys, values = stored_run(20, torch.bfloat16)
    if bad is not None:
        store = corrupt_store(store, plan, bad, "crc")
    buffers = slot(torch.bfloat16, "cpu")
    load = loader.RunLoad(buffers, verify, loader.StagingRing(pinned=False))
    for index, (chunk, (key, blob)) in enumerate(zip(plan.chunks.chunks, store.fetch(list(plan.prefix_keys)))):
        load.add(index, key, blob, read_header(blob), chunk.start, chunk.end)
    failed = load.finish()
    assert failed == (bad if verify else None)
    good = 20 if bad is None else bad  # unverified, the flipped byte is placed as read (the store checked it)
    assert torch.equal(buffers[0][:, :, : good * CHUNK], keys[:, :, : good * CHUNK])
    assert torch.equal(buffers[1][:, :, : good * CHUNK], values[:, :, : good * CHUNK])


def test_staging_checksums_every_piece_of_a_large_blob(monkeypatch):
    monkeypatch.setattr(loader, "STAGE_PIECE", 1000)  # many pieces per blob
    from inference_service.kv.codec import read_header
    import numpy as np

    keys, values = computed_kv(CHUNK, torch.float32)
    blob = bytearray(encode_chunk(keys, values, 0))
    header = read_header(blob)
    staged = np.zeros(len(blob), dtype=np.uint8)
    assert loader._stage(memoryview(blob), staged, header.checksum) and staged.tobytes() == bytes(blob)
    for position in (HEADER_SIZE, HEADER_SIZE + 999, HEADER_SIZE + 1000, len(blob) - 1):
        damaged = bytearray(blob)
        damaged[position] ^= 1
        assert not loader._stage(memoryview(damaged), staged, header.checksum), position
    assert loader._stage(memoryview(blob), staged, None), "nothing to check: the store checked it"
