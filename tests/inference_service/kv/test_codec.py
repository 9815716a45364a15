"""Blob codec: bit-exact 16-bit round trips, header fields, every corruption refused with a reason."""
from __future__ import annotations

import struct
import zlib

import pytest
import torch

from inference_service.kv.codec import (
    BLOB_FORMAT_VERSION, HEADER_SIZE, KEYS_BEFORE_ROPE, MAGIC, BlobError, BlobHeader, decode_chunk, encode_chunk, read_header,
)
from inference_service.kv.quant import dequantize, quantize_keys, quantize_values

SHAPE = (2, 3, 5, 8)  # [layers, kv_heads, tokens, head_dim]
# Byte offsets of header fields (version 3 layout "<4sHBBHHHHqIHHIQI").
VERSION_OFFSET, FLAGS_OFFSET, START_POSITION_OFFSET, NUM_TOKENS_OFFSET, SINK_TOKENS_OFFSET, RESERVED_OFFSET = (
    4, 14, 16, 24, 30, 32)
INT_VIEWS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def make_kv(shape=SHAPE, dtype=torch.float32, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    return keys, values


def make_blob(shape=SHAPE, dtype=torch.float32, start_position=0, bits=16, group_size=32) -> bytes:
    keys, values = make_kv(shape, dtype)
    return encode_chunk(keys, values, start_position, bits=bits, group_size=group_size)


def flip_byte(blob: bytes, offset: int) -> bytes:
    corrupted = bytearray(blob)
    corrupted[offset] ^= 0x01
    return bytes(corrupted)


def assert_bit_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.view(INT_VIEWS[actual.dtype]), expected.view(INT_VIEWS[expected.dtype]))


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_16_bit_round_trip_is_bit_exact(dtype):
    keys, values = make_kv(dtype=dtype)
    # Values whose bits a lossy path would change: signed zero, subnormals, infinities, NaN.
    finfo = torch.finfo(dtype)
    keys[0, 0, 0, :5] = torch.tensor([-0.0, finfo.tiny / 4, float("inf"), float("-inf"), float("nan")]).to(dtype)
    decoded = decode_chunk(encode_chunk(keys, values, start_position=0))
    assert_bit_identical(decoded.keys, keys)
    assert_bit_identical(decoded.values, values)


@pytest.mark.parametrize(
    "as_buffer",
    [bytes, bytearray, memoryview, lambda blob: memoryview(bytearray(blob)), lambda blob: memoryview(b"pad" + blob)[3:]],
    ids=["bytes", "bytearray", "memoryview-readonly", "memoryview-writable", "memoryview-slice"],
)
def test_decode_accepts_every_buffer_type(as_buffer):
    keys, values = make_kv()
    blob = encode_chunk(keys, values, start_position=0)
    decoded = decode_chunk(as_buffer(blob))
    assert torch.equal(decoded.keys, keys) and torch.equal(decoded.values, values)


def test_tensors_decoded_from_bytes_do_not_share_the_blob():
    keys, values = make_kv()
    blob = encode_chunk(keys, values, start_position=0)
    snapshot = bytes(bytearray(blob))
    decoded = decode_chunk(blob)
    decoded.keys.add_(1.0)
    decoded.values.zero_()
    assert blob == snapshot


def test_non_contiguous_inputs_encode_like_their_contiguous_copies():
    keys, values = make_kv(shape=(2, 5, 3, 8))
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [2, 3, 5, 8], not contiguous
    decoded = decode_chunk(encode_chunk(keys, values, start_position=0))
    assert torch.equal(decoded.keys, keys) and torch.equal(decoded.values, values)


def test_decode_converts_to_the_requested_dtype():
    keys, values = make_kv()
    decoded = decode_chunk(encode_chunk(keys, values, start_position=0), dtype=torch.float16)
    assert decoded.keys.dtype == torch.float16
    assert torch.equal(decoded.keys, keys.half())
    assert decoded.header.dtype == "float32"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantized_round_trip_keeps_shape_dtype_and_is_close(bits, dtype):
    keys, values = make_kv(shape=(2, 3, 37, 8), dtype=dtype)  # 37 tokens: a partial key group
    decoded = decode_chunk(encode_chunk(keys, values, start_position=4, bits=bits, group_size=8))
    assert decoded.keys.shape == decoded.values.shape == (2, 3, 37, 8)
    assert decoded.keys.dtype == decoded.values.dtype == dtype
    # randn spans about 8 units per group: step 8/255 at 8 bits, 8/15 at 4 bits; error <= step / 2.
    tolerance = {8: 0.03, 4: 0.4}[bits]
    assert (decoded.keys.float() - keys.float()).abs().max() < tolerance
    assert (decoded.values.float() - values.float()).abs().max() < tolerance


def sink_like_keys(shape=(2, 3, 128, 64), seed=0) -> torch.Tensor:
    """Keys whose first token is 20x smaller than the others, as SmolLM2's attention sink is in most layers
    (its key norm is 0.15-0.5x the chunk's median): quantized with its channels, it loses most of its bits."""
    keys, _ = make_kv(shape, seed=seed)
    keys[:, :, 0] *= 0.05
    return keys


@pytest.mark.parametrize("bits", [8, 4])
def test_the_sink_token_is_stored_as_float16_at_8_and_4_bits(bits):
    keys, values = sink_like_keys(), make_kv((2, 3, 128, 64), seed=1)[1]
    decoded = decode_chunk(encode_chunk(keys, values, start_position=0, bits=bits, group_size=64))
    assert decoded.header.sink_tokens == 1
    assert torch.equal(decoded.keys[:, :, 0], keys[:, :, 0].half().float())
    assert torch.equal(decoded.values[:, :, 0], values[:, :, 0].half().float())
    # Quantized along with its channels (format version 1), the same token's key error would be ~11%
    # (8 bits) or ~180% (4 bits) of its own norm, 20x the other tokens' relative error.
    quantized = dequantize(quantize_keys(keys, bits, 64), torch.float32)
    old_error = (quantized[:, :, 0] - keys[:, :, 0]).norm() / keys[:, :, 0].norm()
    assert old_error > {8: 0.05, 4: 1.0}[bits]
    assert (decoded.keys[:, :, 0] - keys[:, :, 0]).norm() / keys[:, :, 0].norm() < 1e-3
    # The other tokens are quantized as before: within half a step of their channel group.
    rest = quantize_keys(keys[:, :, 1:], bits, 64)
    assert torch.equal(decoded.keys[:, :, 1:], dequantize(rest, torch.float32))


@pytest.mark.parametrize(("start_position", "sink_positions", "expected"),
                         [(0, 1, 1), (0, 4, 4), (2, 4, 2), (4, 4, 0), (128, 1, 0), (0, 0, 0), (0, 99, 5)])
def test_sink_tokens_are_the_chunk_tokens_at_positions_below_sink_positions(start_position, sink_positions, expected):
    keys, values = make_kv()  # 5 tokens
    blob = encode_chunk(keys, values, start_position, bits=8, group_size=4, sink_positions=sink_positions)
    decoded = decode_chunk(blob)
    assert decoded.header.sink_tokens == expected
    assert torch.equal(decoded.keys[:, :, :expected], keys[:, :, :expected].half().float())
    assert (decoded.keys - keys).abs().max() < 0.03 and (decoded.values - values).abs().max() < 0.03
    # 16 bits stores every token as is and has no sink tokens.
    assert read_header(encode_chunk(keys, values, start_position, sink_positions=sink_positions)).sink_tokens == 0


def test_a_chunk_of_sink_tokens_only_round_trips():
    keys, values = make_kv(shape=(2, 3, 1, 8))
    blob = encode_chunk(keys, values, start_position=0, bits=4, group_size=8)
    header = read_header(blob)
    assert header.sink_tokens == 1 and header.payload_bytes == 2 * (2 * 3 * 8) * 2  # float16 K and V only
    decoded = decode_chunk(blob)
    assert torch.equal(decoded.keys, keys.half().float()) and torch.equal(decoded.values, values.half().float())


def test_values_are_quantized_symmetrically():
    keys, values = make_kv(shape=(2, 3, 16, 8))
    values[:, :, 3] = 0.0
    decoded = decode_chunk(encode_chunk(keys, values, start_position=16, bits=8, group_size=8))
    assert torch.equal(decoded.values[:, :, 3], values[:, :, 3])  # 0 is on the grid
    expected = dequantize(quantize_values(values, 8, 8, symmetric=True), torch.float32)
    assert torch.equal(decoded.values, expected)


def encode_version_1(keys: torch.Tensor, values: torch.Tensor, start_position: int, bits: int, group_size: int) -> bytes:
    """A quantized blob as format version 1 wrote it: header "<4sHBBIIIIqIQI", then keys codes, scale,
    zero, values codes, scale, zero (values asymmetric), each section 8-byte aligned; no sink tokens."""
    quantized_keys, quantized_values = quantize_keys(keys, bits, group_size), quantize_values(values, bits, group_size)
    sections = [tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                for tensor in (quantized_keys.data, quantized_keys.scale, quantized_keys.zero,
                               quantized_values.data, quantized_values.scale, quantized_values.zero)]
    payload = b""
    for section in sections[:-1]:
        payload += section + b"\0" * (-len(section) % 8)  # padding between sections, none after the last
    payload += sections[-1]
    header = struct.Struct("<4sHBBIIIIqIQI")
    head = bytearray(header.pack(MAGIC, 1, 1, bits, *keys.shape, start_position, group_size, len(payload), 0))
    checksum = zlib.crc32(payload, zlib.crc32(bytes(head[: HEADER_SIZE - 4])))
    struct.pack_into("<I", head, HEADER_SIZE - 4, checksum)
    return bytes(head) + payload


@pytest.mark.parametrize("bits", [8, 4])
def test_version_1_blobs_still_decode(bits):
    keys, values = make_kv(shape=(2, 3, 37, 8))
    blob = encode_version_1(keys, values, start_position=0, bits=bits, group_size=8)
    decoded = decode_chunk(blob)
    assert decoded.header.version == 1 and decoded.header.sink_tokens == 0 and decoded.header.group_size == 8
    assert torch.equal(decoded.keys, dequantize(quantize_keys(keys, bits, 8), torch.float32))
    assert torch.equal(decoded.values, dequantize(quantize_values(values, bits, 8), torch.float32))
    # Any change to its payload size is still caught.
    with pytest.raises(BlobError, match="header/size mismatch"):
        read_header(blob + b"\0")


def as_version_2(blob: bytes) -> bytes:
    """A version 3 blob without flags, rewritten with the version 2 header "<4sHBBIIIIqHHQI" (the
    payload layout is the same), as version 2 wrote it."""
    header = read_header(blob)
    assert header.flags == 0
    head = bytearray(struct.Struct("<4sHBBIIIIqHHQI").pack(
        MAGIC, 2, {"float32": 1, "float16": 2, "bfloat16": 3}[header.dtype], header.bits, *header.shape,
        header.start_position, header.group_size, header.sink_tokens, header.payload_bytes, 0))
    payload = blob[HEADER_SIZE:]
    struct.pack_into("<I", head, HEADER_SIZE - 4, zlib.crc32(payload, zlib.crc32(bytes(head[: HEADER_SIZE - 4]))))
    return bytes(head) + payload


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_version_2_blobs_still_decode(bits):
    keys, values = make_kv(shape=(2, 3, 37, 8))
    current = encode_chunk(keys, values, start_position=0, bits=bits, group_size=8)
    decoded, expected = decode_chunk(as_version_2(current)), decode_chunk(current)
    assert decoded.header.version == 2 and decoded.header.flags == 0
    assert (decoded.header.sink_tokens, decoded.header.group_size) == (expected.header.sink_tokens, 8)
    assert torch.equal(decoded.keys, expected.keys) and torch.equal(decoded.values, expected.values)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_keys_before_rope_flag_round_trips(bits):
    keys, values = make_kv()
    plain = read_header(encode_chunk(keys, values, start_position=640, bits=bits))
    flagged = decode_chunk(encode_chunk(keys, values, start_position=640, bits=bits, keys_before_rope=True))
    assert (plain.flags, plain.keys_before_rope) == (0, False)
    header = flagged.header
    assert (header.flags, header.keys_before_rope, header.start_position) == (KEYS_BEFORE_ROPE, True, 640)
    # The flag changes nothing in the payload: the keys come back as given, for the reader to rotate.
    expected = decode_chunk(encode_chunk(keys, values, start_position=640, bits=bits))
    assert torch.equal(flagged.keys, expected.keys) and torch.equal(flagged.values, expected.values)


@pytest.mark.parametrize("offset, value, message", [
    (FLAGS_OFFSET, 0x2, "unknown flags 0x0002"),
    (RESERVED_OFFSET, 1, "reserved field 0x1"),
])
def test_unknown_flags_and_reserved_bits_are_refused(offset, value, message):
    blob = bytearray(make_blob())
    struct.pack_into("<H", blob, offset, value)
    with pytest.raises(BlobError, match=message):
        read_header(bytes(blob))


def test_dims_beyond_the_header_fields_are_refused():
    keys = torch.zeros(1, 1, 1, 2**16)
    with pytest.raises(ValueError, match="at most 65535"):
        encode_chunk(keys, keys, start_position=0)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_decode_onto_cuda_matches_cpu(bits):
    blob = make_blob(shape=(2, 3, 37, 8), dtype=torch.float16, bits=bits, group_size=8)
    on_cpu, on_gpu = decode_chunk(blob), decode_chunk(blob, device="cuda")
    assert on_gpu.keys.device.type == on_gpu.values.device.type == "cuda"
    # 16 bits copies bytes; dequantization may round differently (FMA) in the last fp16 bit.
    tolerance = 0 if bits == 16 else 1e-3
    torch.testing.assert_close(on_gpu.keys.cpu(), on_cpu.keys, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(on_gpu.values.cpu(), on_cpu.values, atol=tolerance, rtol=tolerance)
    if bits == 16:  # encoding straight from CUDA tensors gives the same bytes
        assert encode_chunk(on_gpu.keys, on_gpu.values, start_position=0, group_size=8) == blob


# --- header ------------------------------------------------------------------------------------


def test_header_fields_describe_the_chunk():
    blob = make_blob(shape=(2, 3, 5, 8), dtype=torch.bfloat16, start_position=1280)
    header = read_header(blob)
    payload_bytes = 2 * (2 * 3 * 5 * 8) * 2  # keys and values, 2 bytes per bfloat16
    checksum = zlib.crc32(blob[HEADER_SIZE:], zlib.crc32(blob[: HEADER_SIZE - 4]))
    assert header == BlobHeader(
        version=BLOB_FORMAT_VERSION, dtype="bfloat16", bits=16, num_layers=2, num_kv_heads=3, num_tokens=5,
        head_dim=8, start_position=1280, group_size=32, payload_bytes=payload_bytes, checksum=checksum,
    )
    assert HEADER_SIZE == 48 and len(blob) == header.total_bytes == 48 + payload_bytes
    assert blob[:4] == b"KVBC"
    assert struct.unpack_from("<q", blob, START_POSITION_OFFSET) == (1280,)


def test_decoded_chunk_carries_header_and_start_position():
    decoded = decode_chunk(make_blob(start_position=2**40, bits=8, group_size=4))
    assert decoded.header.start_position == 2**40
    assert (decoded.header.bits, decoded.header.group_size, decoded.header.dtype) == (8, 4, "float32")
    assert decoded.keys.shape == decoded.values.shape == SHAPE


def test_encode_refuses_bad_inputs():
    keys, values = make_kv()
    with pytest.raises(ValueError, match="share one 4-D shape"):
        encode_chunk(keys, values[:, :, :4], start_position=0)
    with pytest.raises(ValueError, match="share a dtype"):
        encode_chunk(keys, values.half(), start_position=0)
    with pytest.raises(ValueError, match="unsupported K/V dtype"):
        encode_chunk(keys.double(), values.double(), start_position=0)
    with pytest.raises(ValueError, match="bits must be one of"):
        encode_chunk(keys, values, start_position=0, bits=2)
    with pytest.raises(ValueError, match="start_position >= 0"):
        encode_chunk(keys, values, start_position=-1)
    with pytest.raises(ValueError, match="0 < group_size <= 65535"):  # a 16-bit header field
        encode_chunk(keys, values, start_position=0, bits=8, group_size=2**16)
    with pytest.raises(ValueError, match="beyond the float16 range"):  # the sink token is stored as float16
        encode_chunk(keys * 1e5, values, start_position=0, bits=8)


# --- corruption --------------------------------------------------------------------------------


def test_truncated_blob_is_refused():
    blob = make_blob()
    with pytest.raises(BlobError, match="truncated blob: header says 1920 payload bytes, 1919 present"):
        decode_chunk(blob[:-1])
    with pytest.raises(BlobError, match="truncated blob: 10 bytes, shorter than the 48-byte header"):
        read_header(blob[:10])


def test_flipped_payload_byte_fails_the_checksum():
    blob = flip_byte(make_blob(), HEADER_SIZE + 100)
    read_header(blob)  # the header alone is still consistent
    with pytest.raises(BlobError, match="corrupted blob: checksum .* does not match"):
        decode_chunk(blob)
    # verify=False trusts the bytes (for callers that checked them already).
    assert decode_chunk(blob, verify=False).keys.shape == SHAPE


def test_flipped_header_byte_is_caught():
    # A field that no size check can catch: only the checksum covers it.
    with pytest.raises(BlobError, match="corrupted blob: checksum"):
        decode_chunk(flip_byte(make_blob(start_position=64), START_POSITION_OFFSET))
    # A dimension (5 tokens -> 4): the sizes no longer agree.
    with pytest.raises(BlobError, match="header/size mismatch: header says 1920 payload bytes, its dims and bits need 1536"):
        read_header(flip_byte(make_blob(), NUM_TOKENS_OFFSET))


def test_bad_magic_is_refused():
    blob = b"XXXX" + make_blob()[4:]
    with pytest.raises(BlobError, match="bad magic b'XXXX'"):
        decode_chunk(blob)


@pytest.mark.parametrize("version", [0, BLOB_FORMAT_VERSION + 1])
def test_wrong_version_is_refused(version):
    blob = bytearray(make_blob())
    struct.pack_into("<H", blob, VERSION_OFFSET, version)
    with pytest.raises(BlobError, match=f"unsupported blob format version {version} "):
        decode_chunk(bytes(blob))


def test_header_with_more_sink_tokens_than_tokens_is_refused():
    blob = bytearray(make_blob(bits=8))  # 5 tokens from position 0: 1 sink token
    assert read_header(bytes(blob)).sink_tokens == 1
    struct.pack_into("<H", blob, SINK_TOKENS_OFFSET, 6)
    with pytest.raises(BlobError, match="header/size mismatch: 6 sink tokens in a 8-bit chunk of 5 tokens"):
        read_header(bytes(blob))
    blob16 = bytearray(make_blob(bits=16))
    struct.pack_into("<H", blob16, SINK_TOKENS_OFFSET, 1)
    with pytest.raises(BlobError, match="1 sink tokens in a 16-bit chunk"):
        read_header(bytes(blob16))


def test_header_claiming_more_bytes_than_present_is_refused():
    # The header of an 8-token chunk on the payload of a 4-token chunk.
    long_blob, short_blob = make_blob(shape=(2, 3, 8, 8)), make_blob(shape=(2, 3, 4, 8))
    spliced = long_blob[:HEADER_SIZE] + short_blob[HEADER_SIZE:]
    with pytest.raises(BlobError, match="truncated blob: header says 3072 payload bytes, 1536 present"):
        read_header(spliced)


def test_trailing_bytes_are_refused():
    with pytest.raises(BlobError, match="header/size mismatch: header says 1920 payload bytes, 1921 present"):
        read_header(make_blob() + b"\x00")


# --- size --------------------------------------------------------------------------------------


def test_quantized_blobs_are_smaller_by_the_expected_ratios():
    shape = (2, 2, 128, 64)  # one 128-token chunk, head_dim 64, not at the start of the prompt
    numel = 2 * 2 * 128 * 64
    fp32_16bit = len(make_blob(shape, torch.float32, start_position=128))
    fp16_16bit = len(make_blob(shape, torch.float16, start_position=128))
    fp16_8bit_g64 = len(make_blob(shape, torch.float16, start_position=128, bits=8, group_size=64))
    fp16_8bit_g128 = len(make_blob(shape, torch.float16, start_position=128, bits=8, group_size=128))
    fp16_8bit_g32 = len(make_blob(shape, torch.float16, start_position=128, bits=8, group_size=32))
    fp16_4bit_g64 = len(make_blob(shape, torch.float16, start_position=128, bits=4, group_size=64))
    assert fp32_16bit == 48 + 2 * numel * 4
    assert fp16_16bit == 48 + 2 * numel * 2
    # 8 bits: one code byte per element, plus float16 scale and zero for keys per channel per token
    # group ([2, 2, 2, 64] at group 64) and a float16 scale only for values per token per channel
    # group ([2, 2, 128, 1]): values are symmetric.
    assert fp16_8bit_g64 == 48 + 2 * numel + 2 * 2 * (2 * 2 * 2 * 64) + 2 * (2 * 2 * 128)
    assert fp16_8bit_g128 == 48 + 2 * numel + 2 * 2 * (2 * 2 * 64) + 2 * (2 * 2 * 128)
    assert fp16_8bit_g32 == 48 + 2 * numel + 2 * 2 * (2 * 2 * 4 * 64) + 2 * (2 * 2 * 128 * 2)
    assert fp16_16bit / fp16_8bit_g64 >= 1.9  # 1.91
    assert fp16_16bit / fp16_8bit_g128 >= 1.93  # 1.94
    assert fp32_16bit / fp16_8bit_g64 >= 3.8  # 3.82: the same 8-bit blob from fp32 K/V
    assert 1.8 <= fp16_16bit / fp16_8bit_g32 < 1.9  # 1.83
    assert fp16_16bit / fp16_4bit_g64 >= 3.5  # 3.56
    # The first chunk of a prompt also holds its sink token as float16 K and V (+2 * 2 * 2 * 64 * 2
    # bytes) instead of codes and the token's value scale.
    first = len(make_blob(shape, torch.float16, start_position=0, bits=8, group_size=64))
    sink_bytes, sink_codes = 2 * (2 * 2 * 64) * 2, 2 * (2 * 2 * 64) + 2 * (2 * 2)
    assert first == fp16_8bit_g64 + sink_bytes - sink_codes
    assert fp16_16bit / first >= 1.89  # 1.896
