"""Chunk K/V <-> bytes: a fixed little-endian header, then raw or KIVI-quantized tensor sections (never pickle)."""
from __future__ import annotations

import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Union

import torch

from cache_daemon.checksum import crc32
from inference_service.quant import (
    QuantizedTensor,
    dequantize,
    num_elements,
    packed_num_bytes,
    quantize_keys,
    quantize_values,
    scale_shape_for,
)

BLOB_FORMAT_VERSION = 1
MAGIC = b"KVBC"
# magic, version, dtype code, bits, layers, kv_heads, tokens, head_dim, start_position, group_size,
# payload_bytes, checksum. 48 bytes, so the payload starts 16-byte aligned.
_HEADER = struct.Struct("<4sHBBIIIIqIQI")
HEADER_SIZE = _HEADER.size
_CHECKSUM_OFFSET = HEADER_SIZE - 4
_SECTION_ALIGNMENT = 8  # every tensor section starts at a multiple of 8 bytes, so views of it are aligned

_DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ELEMENT_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
SUPPORTED_BITS = (16, 8, 4)

BlobBuffer = Union[bytes, bytearray, memoryview]

assert sys.byteorder == "little", "the blob layout stores tensor memory as is and assumes a little-endian host"


class BlobError(ValueError):
    """A blob that cannot be decoded: truncated, corrupted, bad magic, unsupported version, size mismatch."""


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
    keys: torch.Tensor, values: torch.Tensor, start_position: int, bits: int = 16, group_size: int = 32
) -> bytes:
    """One chunk's K/V as a self-describing blob.

    Args:
        keys, values: [layers, kv_heads, tokens, head_dim], same shape and dtype (float32, float16
            or bfloat16), on any device.
        start_position: position of the chunk's first token.
        bits: 16 stores the tensors unquantized in their own dtype (bit-exact); 8 or 4 quantize
            keys per channel and values per token in groups of `group_size`.
    Raises:
        ValueError: unsupported dtype, bits, shape or start position.
    """
    if keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(f"keys and values must share one 4-D shape, got {tuple(keys.shape)} and {tuple(values.shape)}")
    if keys.dtype != values.dtype:
        raise ValueError(f"keys and values must share a dtype, got {keys.dtype} and {values.dtype}")
    dtype = _dtype_name(keys.dtype)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size <= 0 or start_position < 0 or min(keys.shape) <= 0:
        raise ValueError(f"need group_size > 0, start_position >= 0 and no empty dims, got {group_size}, {start_position}, {tuple(keys.shape)}")
    if bits == 16:
        tensors = [keys, values]
    else:
        quantized_keys = quantize_keys(keys, bits, group_size)
        quantized_values = quantize_values(values, bits, group_size)
        tensors = [quantized_keys.data, quantized_keys.scale, quantized_keys.zero,
                   quantized_values.data, quantized_values.scale, quantized_values.zero]
    num_layers, num_kv_heads, num_tokens, head_dim = keys.shape
    sections = _layout(dtype, bits, tuple(keys.shape), group_size)
    payload_bytes = sections[-1].offset + sections[-1].num_bytes
    blob = bytearray(HEADER_SIZE + payload_bytes)
    payload = torch.frombuffer(blob, dtype=torch.uint8, offset=HEADER_SIZE, count=payload_bytes)
    for section, tensor in zip(sections, tensors):
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        assert raw.numel() == section.num_bytes, f"section {section.name}: {raw.numel()} bytes, layout says {section.num_bytes}"
        payload[section.offset : section.offset + section.num_bytes].copy_(raw)
    _HEADER.pack_into(blob, 0, MAGIC, BLOB_FORMAT_VERSION, _DTYPE_CODES[dtype], bits, num_layers, num_kv_heads,
                      num_tokens, head_dim, start_position, group_size, payload_bytes, 0)
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
    (magic, version, dtype_code, bits, num_layers, num_kv_heads, num_tokens, head_dim, start_position,
     group_size, payload_bytes, checksum) = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlobError(f"bad magic {bytes(magic)!r}: not a KV chunk blob (expected {MAGIC!r})")
    if version != BLOB_FORMAT_VERSION:
        raise BlobError(f"unsupported blob format version {version} (this build reads version {BLOB_FORMAT_VERSION})")
    if dtype_code not in _DTYPE_NAMES:
        raise BlobError(f"header/size mismatch: unknown dtype code {dtype_code}")
    if bits not in SUPPORTED_BITS:
        raise BlobError(f"header/size mismatch: unsupported bits {bits}")
    if min(num_layers, num_kv_heads, num_tokens, head_dim) <= 0 or group_size <= 0 or start_position < 0:
        raise BlobError(f"header/size mismatch: invalid dims {(num_layers, num_kv_heads, num_tokens, head_dim)}, "
                        f"group_size {group_size} or start_position {start_position}")
    dtype = _DTYPE_NAMES[dtype_code]
    sections = _layout(dtype, bits, (num_layers, num_kv_heads, num_tokens, head_dim), group_size)
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
                      group_size, payload_bytes, checksum)


def decode_chunk(
    blob: BlobBuffer, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, verify: bool = True
) -> DecodedChunk:
    """Tensors straight from the blob's payload (torch.frombuffer, no per-element Python work).

    Args:
        device, dtype: where and in what dtype keys/values come back (default: the header's dtype).
        verify: check the CRC-32 first.
    Returns:
        keys/values [layers, kv_heads, tokens, head_dim]. A read-only blob (bytes) is copied once;
        a writable one (bytearray, memoryview) may be shared by the CPU tensors, not copied.
    Raises:
        BlobError: see read_header; also a checksum mismatch when verify is set.
    """
    view = memoryview(blob).cast("B")
    header = read_header(view)
    if verify:
        actual = _checksum(view)
        if actual != header.checksum:
            raise BlobError(f"corrupted blob: checksum {actual:#010x} does not match the header's {header.checksum:#010x}")
    source_dtype = _TORCH_DTYPES[header.dtype]
    target_dtype = source_dtype if dtype is None else dtype
    payload = _payload_tensor(view, header.payload_bytes)
    sections = {s.name: payload[s.offset : s.offset + s.num_bytes] for s in _layout(header.dtype, header.bits, header.shape, header.group_size)}
    if header.bits == 16:
        keys = _to(sections["keys"].view(source_dtype).view(header.shape), device, target_dtype, view.readonly)
        values = _to(sections["values"].view(source_dtype).view(header.shape), device, target_dtype, view.readonly)
    else:
        keys = dequantize(_quantized(sections, "keys", header, "channel", device), target_dtype)
        values = dequantize(_quantized(sections, "values", header, "token", device), target_dtype)
    return DecodedChunk(header, keys, values)


def _layout(dtype: str, bits: int, shape: tuple[int, ...], group_size: int) -> list[_Section]:
    """The payload's sections in order; the single source of truth for encode, decode and size checks."""
    numel = num_elements(shape)
    if bits == 16:
        sizes = [("keys", numel * _ELEMENT_SIZES[dtype]), ("values", numel * _ELEMENT_SIZES[dtype])]
    else:
        scale_bytes = lambda axis: num_elements(scale_shape_for(shape, group_size, axis)) * 2  # float16
        sizes = [("keys", packed_num_bytes(numel, bits)), ("keys.scale", scale_bytes("channel")),
                 ("keys.zero", scale_bytes("channel")), ("values", packed_num_bytes(numel, bits)),
                 ("values.scale", scale_bytes("token")), ("values.zero", scale_bytes("token"))]
    sections, offset = [], 0
    for name, num_bytes in sizes:
        sections.append(_Section(name, offset, num_bytes))
        offset = -(-(offset + num_bytes) // _SECTION_ALIGNMENT) * _SECTION_ALIGNMENT
    return sections


def _checksum(view: memoryview) -> int:
    """CRC-32 over the header without its checksum field, then the payload."""
    return crc32(view[HEADER_SIZE:], crc32(view[:_CHECKSUM_OFFSET]))


def _payload_tensor(view: memoryview, payload_bytes: int) -> torch.Tensor:
    """uint8 [payload_bytes] sharing the blob's memory."""
    with warnings.catch_warnings():
        # A read-only buffer makes torch warn; decode never writes to it and copies before returning.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8, offset=HEADER_SIZE, count=payload_bytes)


def _to(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype, must_copy: bool) -> torch.Tensor:
    moved = tensor.to(device=device, dtype=dtype)
    if must_copy and moved.data_ptr() == tensor.data_ptr():
        moved = moved.clone()  # never hand out a tensor over immutable bytes
    return moved


def _quantized(sections: dict[str, torch.Tensor], name: str, header: BlobHeader, axis: str, device) -> QuantizedTensor:
    scale_shape = scale_shape_for(header.shape, header.group_size, axis)
    return QuantizedTensor(
        data=sections[name].to(device),
        scale=sections[f"{name}.scale"].view(torch.float16).view(scale_shape).to(device),
        zero=sections[f"{name}.zero"].view(torch.float16).view(scale_shape).to(device),
        bits=header.bits, group_size=header.group_size, axis=axis, shape=header.shape,
    )


def _dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in _TORCH_DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"unsupported K/V dtype {dtype}; expected one of {sorted(_TORCH_DTYPES)}")
