"""Write-back picks the quantization group by bits when none is configured."""
from __future__ import annotations

import torch

from kvboost_keys.chunking import Chunk
from inference_service.kv.codec import read_header
from inference_service.reuse.writeback import PendingChunks, encode_pending
from inference_service.kv.blobs import group_size_for


def test_group_size_defaults_by_bits_and_an_explicit_one_wins():
    assert (group_size_for(8, 0), group_size_for(4, 0)) == (64, 128)
    assert (group_size_for(8, 32), group_size_for(4, 32)) == (32, 32)


def pending(num_tokens: int = 130) -> PendingChunks:
    generator = torch.Generator().manual_seed(0)
    new_kv = [(torch.randn(1, 2, num_tokens, 8, generator=generator), torch.randn(1, 2, num_tokens, 8, generator=generator))
              for _ in range(2)]
    chunks = (Chunk(tuple(range(128)), 0, 0), Chunk((1, 2), 128, 0))
    return PendingChunks(b"ns", chunks, (b"k0", b"k1"), (None, None), new_kv, kv_start=0)


def test_encode_pending_stores_the_default_group_and_the_sink_token_in_the_first_chunk():
    for bits, group in ((8, 64), (4, 128)):
        first, second = (read_header(item.blob) for item in encode_pending(pending(), bits))
        assert (first.group_size, second.group_size) == (group, group)
        assert (first.sink_tokens, second.sink_tokens) == (1, 0)
    assert read_header(encode_pending(pending(), 8, group_size=16)[0].blob).group_size == 16
    assert read_header(encode_pending(pending(), 16)[0].blob).sink_tokens == 0
