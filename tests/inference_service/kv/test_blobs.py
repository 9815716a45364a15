"""decode_hit on crafted blobs: size and shape refused from the header before any decode; NaN/inf is corruption."""
from __future__ import annotations

import struct

import pytest
import torch

from inference_service.kv import codec
from inference_service.kv.blobs import decode_hit
from inference_service.kv.codec import HEADER_SIZE, MAGIC, encode_chunk

SHAPE = (2, 2, 8, 4)  # the model's K/V: [layers, kv_heads, tokens, head_dim]
KEY = b"k" * 32


def kv(shape=SHAPE, fill: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    if fill is not None:
        keys[0, 0, 0, 0] = fill
    return keys, values


def decode(blob: bytes, reported: list[bytes]):
    return decode_hit(KEY, KEY, blob, start=0, num_tokens=SHAPE[2], shape=SHAPE, verify=True,
                      on_corrupt=reported.append)


@pytest.fixture()
def decoding_watched(monkeypatch) -> list[str]:
    """Records every time a blob's payload is decoded (the step that allocates and copies to the device)."""
    calls: list[str] = []
    real = codec._decode_checked_header

    def watched(*args, **kwargs):
        calls.append("decoded")
        return real(*args, **kwargs)

    monkeypatch.setattr(codec, "_decode_checked_header", watched)
    return calls


def test_a_sound_blob_of_the_right_shape_is_decoded(decoding_watched):
    reported: list[bytes] = []
    decoded = decode(encode_chunk(*kv(), start_position=0), reported)
    assert decoded is not None and torch.equal(decoded.keys, kv()[0])
    assert (decoding_watched, reported) == (["decoded"], [])


def test_a_header_claiming_huge_dims_is_refused_before_any_decode(decoding_watched):
    # A 48-byte header that claims 64 layers x 64 heads x 100,000 tokens x 128 dims of float32 (26 GB, its
    # payload_bytes consistent with those dims), followed by a few bytes: the blob is reported corrupt,
    # nothing is allocated for the claim.
    dims = (64, 64, 100_000, 128)
    header = struct.pack("<4sHBBHHHHqIHHIQI", MAGIC, 3, 1, 16, dims[0], dims[1], dims[3], 0, 0, dims[2], 32, 0, 0,
                         2 * dims[0] * dims[1] * dims[2] * dims[3] * 4, 0)
    reported: list[bytes] = []
    assert decode(header + bytes(64), reported) is None
    assert (decoding_watched, reported) == ([], [KEY])


def test_a_well_formed_blob_of_another_shape_is_refused_before_any_decode(decoding_watched):
    # Consistent with its own length, 4-bit (8x smaller than the float32 it would decode to), but for a
    # bigger model: not decoded, not reported (the store may hold it for that model).
    bigger = encode_chunk(*kv((4, 8, 8, 64)), start_position=0, bits=4, group_size=8)
    reported: list[bytes] = []
    assert decode(bigger, reported) is None
    assert (decoding_watched, reported) == ([], [])


@pytest.mark.parametrize("cut", [1, HEADER_SIZE // 2, 100])
def test_a_truncated_blob_is_corrupt(cut, decoding_watched):
    blob = encode_chunk(*kv(), start_position=0)
    reported: list[bytes] = []
    assert decode(blob[:-cut], reported) is None
    assert (decoding_watched, reported) == ([], [KEY])


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
def test_a_well_formed_blob_holding_non_finite_kv_is_corrupt(bits, fill):
    # Valid magic, dims and CRC-32: only the values are wrong.
    keys, values = kv(fill=fill if bits == 16 else None)
    blob = bytearray(encode_chunk(keys, values, start_position=0, bits=bits, group_size=8))
    if bits == 8:  # quantized blobs refuse non-finite input: plant it in the stored float16 sink token
        blob[HEADER_SIZE:HEADER_SIZE + 2] = torch.tensor([fill], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
        struct.pack_into("<I", blob, HEADER_SIZE - 4, codec._checksum(memoryview(blob)))
    reported: list[bytes] = []
    assert decode(bytes(blob), reported) is None
    assert reported == [KEY]


def test_all_finite_sees_one_nan_among_many_values():
    values = torch.zeros(1 << 16, dtype=torch.bfloat16)
    assert codec.all_finite(values)
    values[12345] = float("nan")
    assert not codec.all_finite(values)
