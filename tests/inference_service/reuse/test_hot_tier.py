"""L0: whole chunks' K/V by prefix key, least recently used dropped first within its bytes, copies kept."""
from __future__ import annotations

import torch

from inference_service.reuse.hot_tier import HotTier

CHUNK_BYTES = 2 * 2 * 3 * 4 * 5 * 4  # keys and values [2 layers, 3 heads, 4 tokens, 5 dims] in float32


def chunk(fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((2, 3, 4, 5), fill), torch.full((2, 3, 4, 5), -fill)


def test_a_chunk_comes_back_as_it_was_added_even_when_its_source_changes():
    hot = HotTier(10 * CHUNK_BYTES)
    keys, values = chunk(1.0)
    hot.add(b"a", keys, values)
    keys.fill_(9.0)  # the slot is reused: L0 kept its own copy
    taken = hot.take(b"a")
    assert torch.equal(taken[0], torch.full((2, 3, 4, 5), 1.0)) and torch.equal(taken[1], torch.full((2, 3, 4, 5), -1.0))
    assert hot.take(b"b") is None
    assert hot.snapshot() == {"l0_chunks_hit": 1, "l0_bytes_placed": CHUNK_BYTES, "l0_bytes_held": CHUNK_BYTES,
                              "l0_chunks_held": 1, "l0_chunks_evicted": 0}


def test_the_least_recently_used_chunk_goes_first_when_room_is_needed():
    hot = HotTier(3 * CHUNK_BYTES)
    for name in (b"a", b"b", b"c"):
        hot.add(name, *chunk(1.0))
    hot.take(b"a")  # a is now the most recently used: b is the oldest
    hot.add(b"d", *chunk(2.0))
    assert [name in hot for name in (b"a", b"b", b"c", b"d")] == [True, False, True, True]
    assert hot.bytes_held == 3 * CHUNK_BYTES and hot.snapshot()["l0_chunks_evicted"] == 1


def test_a_chunk_larger_than_the_tier_is_not_kept_and_a_second_add_keeps_the_first_copy():
    hot = HotTier(CHUNK_BYTES - 1)
    hot.add(b"a", *chunk(1.0))
    assert len(hot) == 0 and hot.bytes_held == 0
    hot = HotTier(2 * CHUNK_BYTES)
    hot.add(b"a", *chunk(1.0))
    hot.add(b"a", *chunk(5.0))
    assert hot.take(b"a")[0][0, 0, 0, 0] == 1.0 and hot.bytes_held == CHUNK_BYTES
