"""Chunk K/V <-> bytes: a fixed little-endian header, then raw or KIVI-quantized tensor sections (never pickle).

Format versions (the header's version field):
  1: quantized blobs hold keys per channel and values per token, both asymmetric (scale and zero).
  2: quantized blobs keep the chunk's attention-sink tokens (prompt positions below encode_chunk's
     sink_positions, by default the first token of a prompt) as float16, and quantize values symmetrically
     (scale only; the bytes saved pay for finer key groups at the same size). The header's 32-bit
     group_size field of version 1 is split into a 16-bit group_size and a 16-bit sink_tokens.
     16-bit blobs are laid out as in version 1.
  3: the header gains a flags field (dims that never exceed 65535 shrink to 16 bits to make room);
     flag KEYS_BEFORE_ROPE marks keys stored un-rotated (rotated back to position 0), so a reader
     rotates them to wherever it places them. Payloads are laid out as in version 2.
This build writes version 3 and reads all three.
"""
from __future__ import annotations

import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Union

import torch

from kvboost_common.checksum import crc32
from inference_service.kv.quant import (
    QuantizedTensor, dequantize, num_elements, packed_num_bytes, quantize_keys, quantize_values, scale_shape_for,
)

BLOB_FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MAGIC = b"KVBC"
# Versions 1 and 2: magic, version, dtype code, bits, layers, kv_heads, tokens, head_dim, start_position,
# group_size, [version 2: sink_tokens,] payload_bytes, checksum. Version 3: magic, version, dtype code,
# bits, layers, kv_heads, head_dim, flags, start_position, tokens, group_size, sink_tokens, reserved (0),
# payload_bytes, checksum. Always 48 bytes, so the payload starts 16-byte aligned.
_HEADERS = {1: struct.Struct("<4sHBBIIIIqIQI"), 2: struct.Struct("<4sHBBIIIIqHHQI"),
            3: struct.Struct("<4sHBBHHHHqIHHIQI")}
_HEADER = _HEADERS[BLOB_FORMAT_VERSION]
_MAGIC_AND_VERSION = struct.Struct("<4sH")
HEADER_SIZE = _HEADER.size
assert all(header.size == HEADER_SIZE for header in _HEADERS.values())
MAX_GROUP_SIZE = 2**16 - 1  # group_size is a 16-bit field from version 2 on
MAX_SMALL_DIM = 2**16 - 1  # layers, kv_heads and head_dim are 16-bit fields from version 3 on
MAX_TOKENS = 2**32 - 1
# Header flags (version 3).
KEYS_BEFORE_ROPE = 0x1  # keys are stored un-rotated (as at position 0); readers rotate them into place
_KNOWN_FLAGS = KEYS_BEFORE_ROPE
# At 8 and 4 bits, tokens at prompt positions below this are stored as float16, not quantized: the
# first token is the attention sink, which most heads attend to heavily, so its key error moves every
# attention output (KVQuant, IntactKV keep it in full precision for the same reason).
SINK_POSITIONS = 1
_CHECKSUM_OFFSET = HEADER_SIZE - 4
SECTION_ALIGNMENT = _SECTION_ALIGNMENT = 8  # every tensor section starts at a multiple of 8 bytes, so views of it are aligned

_DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ELEMENT_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
SUPPORTED_BITS = (16, 8, 4)

BlobBuffer = Union[bytes, bytearray, memoryview]

assert sys.byteorder == "little", "the blob layout stores tensor memory as is and assumes a little-endian host"


class BlobError(ValueError):
    """A blob that cannot be decoded: truncated, corrupted, bad magic, unsupported version, size mismatch."""


class UnexpectedShape(BlobError):
    """A well-formed blob whose K/V shape is not the one the caller's model needs (refused before decoding)."""


class NonFiniteValues(BlobError):
    """A blob whose decoded K/V hold NaN or infinity: no model computes those, so the bytes are corrupt."""


@dataclass(slots=True, frozen=True)
class BlobHeader:
    version: int
    dtype: str  # "float32" | "float16" | "bfloat16": the dtype the K/V were computed in
    bits: int  # 16: unquantized, stored in `dtype`; 8 or 4: KIVI-quantized
    num_layers: int
    num_kv_heads: int
    num_tokens: int
    head_dim: int
    start_position: int  # position of the chunk's first token in the prompt it was computed in
    group_size: int  # quantization group size (ignored at 16 bits)
    payload_bytes: int
    checksum: int  # CRC-32 of the header (checksum field excluded) followed by the payload
    sink_tokens: int = 0  # leading tokens stored as float16, not quantized (0 at 16 bits and in version 1)
    flags: int = 0  # KEYS_BEFORE_ROPE (version 3; 0 before)

    @property
    def keys_before_rope(self) -> bool:
        """Keys are un-rotated: every token's key stands at position 0, not at start_position + i."""
        return bool(self.flags & KEYS_BEFORE_ROPE)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.num_tokens, self.head_dim)

    @property
    def total_bytes(self) -> int:
        return HEADER_SIZE + self.payload_bytes


@dataclass(slots=True, frozen=True)
class DecodedChunk:
    header: BlobHeader
    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    values: torch.Tensor  # [layers, kv_heads, tokens, head_dim]


@dataclass(slots=True, frozen=True)
class _Section:
    name: str
    offset: int  # from the start of the payload
    num_bytes: int


def encode_chunk(
    keys: torch.Tensor, values: torch.Tensor, start_position: int, bits: int = 16, group_size: int = 32,
    sink_positions: int = SINK_POSITIONS, keys_before_rope: bool = False,
) -> bytes:
    """One chunk's K/V as a self-describing blob (format version BLOB_FORMAT_VERSION).

    Args:
        keys, values: [layers, kv_heads, tokens, head_dim], same shape and dtype (float32, float16
            or bfloat16), on any device.
        start_position: position of the chunk's first token.
        bits: 16 stores the tensors unquantized in their own dtype (bit-exact); 8 or 4 quantize
            keys per channel (asymmetric) in groups of `group_size` tokens and values per token
            (symmetric) in groups of `group_size` channels.
        sink_positions: at 8 and 4 bits, the chunk's tokens at prompt positions below this are
            stored as float16 instead (the attention sink).
        keys_before_rope: the caller un-rotated `keys` to position 0; sets the KEYS_BEFORE_ROPE flag so
            readers know to rotate them to the positions they place them at.
    Raises:
        ValueError: unsupported dtype, bits, shape, group size or start position, or (quantized)
            values beyond the float16 range.
    """
    if keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(f"keys and values must share one 4-D shape, got {tuple(keys.shape)} and {tuple(values.shape)}")
    if keys.dtype != values.dtype:
        raise ValueError(f"keys and values must share a dtype, got {keys.dtype} and {values.dtype}")
    dtype = _dtype_name(keys.dtype)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if not 0 < group_size <= MAX_GROUP_SIZE or start_position < 0 or min(keys.shape) <= 0 or sink_positions < 0:
        raise ValueError(f"need 0 < group_size <= {MAX_GROUP_SIZE}, start_position >= 0, sink_positions >= 0 and no "
                         f"empty dims, got {group_size}, {start_position}, {sink_positions}, {tuple(keys.shape)}")
    num_layers, num_kv_heads, num_tokens, head_dim = keys.shape
    if max(num_layers, num_kv_heads, head_dim) > MAX_SMALL_DIM or num_tokens > MAX_TOKENS:
        raise ValueError(f"layers, kv_heads and head_dim must be at most {MAX_SMALL_DIM} and tokens at most "
                         f"{MAX_TOKENS}, got shape {tuple(keys.shape)}")
    sink_tokens = 0 if bits == 16 else min(num_tokens, max(0, sink_positions - start_position))
    tensors = []
    if bits == 16:
        tensors += [keys, values]
    else:
        if sink_tokens:
            sink_keys, sink_values = keys[:, :, :sink_tokens].half(), values[:, :, :sink_tokens].half()
            if not (torch.isfinite(sink_keys).all() and torch.isfinite(sink_values).all()):
                raise ValueError("values beyond the float16 range cannot be stored at 8 or 4 bits")
            tensors += [sink_keys, sink_values]
        if sink_tokens < num_tokens:
            quantized_keys = quantize_keys(keys[:, :, sink_tokens:], bits, group_size)
            quantized_values = quantize_values(values[:, :, sink_tokens:], bits, group_size, symmetric=True)
            tensors += [quantized_keys.data, quantized_keys.scale, quantized_keys.zero,
                        quantized_values.data, quantized_values.scale]
    sections = _layout(BLOB_FORMAT_VERSION, dtype, bits, tuple(keys.shape), group_size, sink_tokens)
    assert len(sections) == len(tensors), "one tensor per section"
    payload_bytes = sections[-1].offset + sections[-1].num_bytes
    blob = bytearray(HEADER_SIZE + payload_bytes)
    payload = torch.frombuffer(blob, dtype=torch.uint8, offset=HEADER_SIZE, count=payload_bytes)
    for section, tensor in zip(sections, tensors):
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        assert raw.numel() == section.num_bytes, f"section {section.name}: {raw.numel()} bytes, layout says {section.num_bytes}"
        payload[section.offset : section.offset + section.num_bytes].copy_(raw)
    flags = KEYS_BEFORE_ROPE if keys_before_rope else 0
    _HEADER.pack_into(blob, 0, MAGIC, BLOB_FORMAT_VERSION, _DTYPE_CODES[dtype], bits, num_layers, num_kv_heads,
                      head_dim, flags, start_position, num_tokens, group_size, sink_tokens, 0, payload_bytes, 0)
    checksum = _checksum(memoryview(blob))
    struct.pack_into("<I", blob, _CHECKSUM_OFFSET, checksum)
    return bytes(blob)


def read_header(blob: BlobBuffer) -> BlobHeader:
    """The header of a blob, checked against the blob's length (no checksum, no tensor work).

    Raises:
        BlobError: truncated, bad magic, unsupported version/dtype/bits, or sizes that disagree.
    """
    view = memoryview(blob).cast("B")
    if len(view) < HEADER_SIZE:
        raise BlobError(f"truncated blob: {len(view)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version = _MAGIC_AND_VERSION.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlobError(f"bad magic {bytes(magic)!r}: not a KV chunk blob (expected {MAGIC!r})")
    if version not in READABLE_VERSIONS:
        raise BlobError(f"unsupported blob format version {version} (this build reads versions {READABLE_VERSIONS})")
    flags = reserved = 0
    if version == 1:
        (_, _, dtype_code, bits, num_layers, num_kv_heads, num_tokens, head_dim, start_position,
         group_size, payload_bytes, checksum) = _HEADERS[1].unpack_from(view, 0)
        sink_tokens = 0
    elif version == 2:
        (_, _, dtype_code, bits, num_layers, num_kv_heads, num_tokens, head_dim, start_position,
         group_size, sink_tokens, payload_bytes, checksum) = _HEADERS[2].unpack_from(view, 0)
    else:
        (_, _, dtype_code, bits, num_layers, num_kv_heads, head_dim, flags, start_position, num_tokens,
         group_size, sink_tokens, reserved, payload_bytes, checksum) = _HEADERS[3].unpack_from(view, 0)
    if flags & ~_KNOWN_FLAGS or reserved:
        raise BlobError(f"unsupported blob header: unknown flags {flags:#06x} or reserved field {reserved:#x} set")
    if dtype_code not in _DTYPE_NAMES:
        raise BlobError(f"header/size mismatch: unknown dtype code {dtype_code}")
    if bits not in SUPPORTED_BITS:
        raise BlobError(f"header/size mismatch: unsupported bits {bits}")
    if min(num_layers, num_kv_heads, num_tokens, head_dim) <= 0 or group_size <= 0 or start_position < 0:
        raise BlobError(f"header/size mismatch: invalid dims {(num_layers, num_kv_heads, num_tokens, head_dim)}, "
                        f"group_size {group_size} or start_position {start_position}")
    if sink_tokens > (0 if bits == 16 else num_tokens):
        raise BlobError(f"header/size mismatch: {sink_tokens} sink tokens in a {bits}-bit chunk of {num_tokens} tokens")
    dtype = _DTYPE_NAMES[dtype_code]
    sections = _layout(version, dtype, bits, (num_layers, num_kv_heads, num_tokens, head_dim), group_size, sink_tokens)
    expected_bytes = sections[-1].offset + sections[-1].num_bytes
    if payload_bytes != expected_bytes:
        raise BlobError(f"header/size mismatch: header says {payload_bytes} payload bytes, "
                        f"its dims and bits need {expected_bytes}")
    present = len(view) - HEADER_SIZE
    if present < payload_bytes:
        raise BlobError(f"truncated blob: header says {payload_bytes} payload bytes, {present} present")
    if present > payload_bytes:
        raise BlobError(f"header/size mismatch: header says {payload_bytes} payload bytes, {present} present")
    return BlobHeader(version, dtype, bits, num_layers, num_kv_heads, num_tokens, head_dim, start_position,
                      group_size, payload_bytes, checksum, sink_tokens, flags)


def decode_chunk(
    blob: BlobBuffer, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, verify: bool = True,
    borrow: bool = False, expected_shape: tuple[int, int, int, int] | None = None, check_finite: bool = False,
) -> DecodedChunk:
    """Tensors straight from the blob's payload (torch.frombuffer, no per-element Python work).

    Args:
        device, dtype: where and in what dtype keys/values come back (default: the header's dtype).
        verify: check the CRC-32 first.
        expected_shape: (layers, kv_heads, tokens, head_dim) the caller needs; any other shape is refused
            from the 48-byte header alone, before the checksum pass, any allocation or any device copy
            (read_header has already matched the header's dims and bits with the blob's length).
        check_finite: refuse K/V holding NaN or infinity once decoded (one reduction per tensor).
    Returns:
        keys/values [layers, kv_heads, tokens, head_dim], keys as stored: rotated for positions
        start_position.., or all for position 0 when header.keys_before_rope, for the caller to rotate
        into place. A read-only blob (bytes) is copied once, unless `borrow` says the caller is done with
        the tensors before the blob's memory goes away (a view into a memory map); a writable one
        (bytearray, memoryview) may be shared by the CPU tensors, not copied.
    Raises:
        BlobError: see read_header; also a checksum mismatch when verify is set. UnexpectedShape,
            NonFiniteValues: see expected_shape and check_finite.
    """
    view = memoryview(blob).cast("B")
    header = read_header(view)
    if expected_shape is not None and header.shape != tuple(expected_shape):
        raise UnexpectedShape(f"blob holds K/V of shape {header.shape}, expected {tuple(expected_shape)}")
    decoded = _decode_checked_header(view, header, device, dtype, verify, borrow)
    if check_finite and not (all_finite(decoded.keys) and all_finite(decoded.values)):
        raise NonFiniteValues(f"corrupted blob: its decoded K/V of shape {header.shape} hold NaN or infinity")
    return decoded


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in tensor: one float32 sum, no boolean tensor beside it (NaN and inf propagate;
    finite K/V never sum past float32's 3e38)."""
    return bool(torch.isfinite(tensor.sum(dtype=torch.float32)))


def _decode_checked_header(view: memoryview, header: BlobHeader, device: torch.device | str,
                           dtype: torch.dtype | None, verify: bool, borrow: bool) -> DecodedChunk:
    if verify:
        actual = _checksum(view)
        if actual != header.checksum:
            raise BlobError(f"corrupted blob: checksum {actual:#010x} does not match the header's {header.checksum:#010x}")
    source_dtype = _TORCH_DTYPES[header.dtype]
    target_dtype = source_dtype if dtype is None else dtype
    payload = _payload_tensor(view, header.payload_bytes)
    layout = _layout(header.version, header.dtype, header.bits, header.shape, header.group_size, header.sink_tokens)
    sections = {s.name: payload[s.offset : s.offset + s.num_bytes] for s in layout}
    if header.bits == 16:
        must_copy = view.readonly and not borrow
        keys = _to(sections["keys"].view(source_dtype).view(header.shape), device, target_dtype, must_copy)
        values = _to(sections["values"].view(source_dtype).view(header.shape), device, target_dtype, must_copy)
        return DecodedChunk(header, keys, values)
    sink = header.sink_tokens
    if sink < header.num_tokens:
        keys = dequantize(_quantized(sections, "keys", header, "channel", device, symmetric=False), target_dtype)
        values = dequantize(_quantized(sections, "values", header, "token", device, symmetric=header.version >= 2),
                            target_dtype)
    if sink:  # the float16 sink tokens go in front of the dequantized ones
        sink_shape = (header.num_layers, header.num_kv_heads, sink, header.head_dim)
        sink_keys = sections["sink.keys"].view(torch.float16).view(sink_shape).to(device=device, dtype=target_dtype)
        sink_values = sections["sink.values"].view(torch.float16).view(sink_shape).to(device=device, dtype=target_dtype)
        if sink == header.num_tokens:
            keys, values = sink_keys.clone(), sink_values.clone()  # never over the blob's memory
        else:
            keys, values = torch.cat([sink_keys, keys], dim=2), torch.cat([sink_values, values], dim=2)
    return DecodedChunk(header, keys, values)


def _layout(version: int, dtype: str, bits: int, shape: tuple[int, int, int, int], group_size: int,
            sink_tokens: int) -> list[_Section]:
    """The payload's sections in order; the single source of truth for encode, decode and size checks.

    16 bits: keys, values in `dtype`. Quantized: [sink.keys, sink.values: float16 [layers, kv_heads,
    sink_tokens, head_dim] when sink_tokens > 0], then for the other tokens (when there are any) keys
    codes, keys.scale, keys.zero, values codes, values.scale[, values.zero in version 1].
    """
    if bits == 16:
        numel = num_elements(shape)
        sizes = [("keys", numel * _ELEMENT_SIZES[dtype]), ("values", numel * _ELEMENT_SIZES[dtype])]
    else:
        num_layers, num_kv_heads, num_tokens, head_dim = shape
        sink_numel = num_elements((num_layers, num_kv_heads, sink_tokens, head_dim))
        quantized_shape = (num_layers, num_kv_heads, num_tokens - sink_tokens, head_dim)
        numel = num_elements(quantized_shape)
        scale_bytes = lambda axis: num_elements(scale_shape_for(quantized_shape, group_size, axis)) * 2  # float16
        sizes = [("sink.keys", sink_numel * 2), ("sink.values", sink_numel * 2)] if sink_tokens else []
        if numel:
            sizes += [("keys", packed_num_bytes(numel, bits)), ("keys.scale", scale_bytes("channel")),
                      ("keys.zero", scale_bytes("channel")), ("values", packed_num_bytes(numel, bits)),
                      ("values.scale", scale_bytes("token"))]
            if version == 1:
                sizes.append(("values.zero", scale_bytes("token")))
    sections, offset = [], 0
    for name, num_bytes in sizes:
        sections.append(_Section(name, offset, num_bytes))
        offset = -(-(offset + num_bytes) // _SECTION_ALIGNMENT) * _SECTION_ALIGNMENT
    return sections


def _checksum(view: memoryview) -> int:
    """CRC-32 over the header without its checksum field, then the payload."""
    return crc32(view[HEADER_SIZE:], crc32(view[:_CHECKSUM_OFFSET]))


checksum_of = _checksum  # what a blob's header checksum field must hold (kv.loader checks staged copies with it)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a header's dtype name."""
    return _TORCH_DTYPES[name]


def byte_tensor(view: memoryview, offset: int = 0, count: int = -1) -> torch.Tensor:
    """uint8 tensor sharing a (possibly read-only) buffer's memory, for reading only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about read-only buffers; nothing writes to it
        return torch.frombuffer(view, dtype=torch.uint8, offset=offset, count=count)


def _payload_tensor(view: memoryview, payload_bytes: int) -> torch.Tensor:
    """uint8 [payload_bytes] sharing the blob's memory."""
    return byte_tensor(view, HEADER_SIZE, payload_bytes)  # decode never writes to it and copies before returning


def _to(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype, must_copy: bool) -> torch.Tensor:
    moved = tensor.to(device=device, dtype=dtype)
    if must_copy and moved.data_ptr() == tensor.data_ptr():
        moved = moved.clone()  # never hand out a tensor over immutable bytes
    return moved


def _quantized(sections: dict[str, torch.Tensor], name: str, header: BlobHeader, axis: str, device,
               symmetric: bool) -> QuantizedTensor:
    shape = (header.num_layers, header.num_kv_heads, header.num_tokens - header.sink_tokens, header.head_dim)
    scale_shape = scale_shape_for(shape, header.group_size, axis)
    return QuantizedTensor(
        data=sections[name].to(device),
        scale=sections[f"{name}.scale"].view(torch.float16).view(scale_shape).to(device),
        zero=None if symmetric else sections[f"{name}.zero"].view(torch.float16).view(scale_shape).to(device),
        bits=header.bits, group_size=header.group_size, axis=axis, shape=shape,
    )


def _dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in _TORCH_DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"unsupported K/V dtype {dtype}; expected one of {sorted(_TORCH_DTYPES)}")
