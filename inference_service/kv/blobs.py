"""Chunk K/V <-> blobs, both ways: un-rotate, quantize and encode what write-back stores; decode, check,
dequantize and rotate into the buffers what a hit brings back. Write-back, prefix assembly and content
placement only do I/O and bookkeeping around these functions."""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from inference_service.kv.codec import BlobError, DecodedChunk, UnexpectedShape, decode_chunk, encode_chunk, read_header
from inference_service.kv.rope import RopeParams, UnsupportedRope, check_rerotation, rerotate_keys_

logger = logging.getLogger(__name__)

# Quantization group by bits, when none is configured (0). At 8 bits, 64-token key groups (values
# symmetric per token, the sink token float16) store 128-token chunks of head_dim 64 in 1.90x fewer
# bytes than fp16, with 16% less mean first-token KL than group 128 (bench_accuracy's identity prompts
# on SmolLM2). At 4 bits, group 128 (3.7x fewer) agreed more often in greedy outputs there.
DEFAULT_GROUP_SIZES = {8: 64, 4: 128}
DEFAULT_GROUP_SIZE = 0  # 0: DEFAULT_GROUP_SIZES[bits]


def group_size_for(bits: int, group_size: int) -> int:
    return group_size or DEFAULT_GROUP_SIZES.get(bits, 128)


def encode_chunk_kv(keys: torch.Tensor, values: torch.Tensor, start: int, bits: int,
                    group_size: int = DEFAULT_GROUP_SIZE, rope: RopeParams | None = None) -> bytes:
    """The blob of one chunk's K/V (keys, values: [layers, kv_heads, n, head_dim], computed at positions start..).

    rope: at 8 and 4 bits, keys are un-rotated to position 0 with it before they are quantized (flag
    KEYS_BEFORE_ROPE); None stores keys as the model computed them.
    """
    unrotated = _unrotated(keys, start, rope) if bits != 16 and rope is not None else None
    if unrotated is not None:
        # Un-rotated and quantized in float32: rounding the moved keys back to bf16/fp16 first would add
        # an error as large as part of what 8 bits gain. The blob then says float32 (quantized bytes are
        # the same size), so readers also rotate before rounding into their buffers.
        keys, values = unrotated, values.float()
    return encode_chunk(keys, values, start, bits=bits, group_size=group_size_for(bits, group_size),
                        keys_before_rope=unrotated is not None)


def _unrotated(keys: torch.Tensor, start: int, rope: RopeParams) -> torch.Tensor | None:
    """Keys [layers, kv_heads, n, head_dim] computed at positions start.., rotated back to position 0, in
    float32 (in place when they already are: stack_layers' own tensor). None where the RoPE cannot be
    undone exactly (the keys are then stored as computed).

    Pre-RoPE keys keep each channel near one range whatever the position (RoPE spins channel pairs at
    position-dependent angles, spreading every channel over +-its pair's norm), so per-channel groups
    quantize them with less error (KVQuant).
    """
    positions = torch.arange(start, start + keys.shape[2], device=keys.device)
    try:
        check_rerotation(rope, positions)
    except UnsupportedRope:
        return None
    moved = keys.float()
    rerotate_keys_(moved, positions, torch.zeros_like(positions), rope)
    return moved


def decode_hit(expected_key: bytes, key: bytes, blob, start: int, num_tokens: int, shape: tuple[int, ...],
               verify: bool, same_position: bool = True, rope: RopeParams | None = None,
               device: torch.device | str = "cpu", borrow: bool = False,
               on_corrupt: Callable[[bytes], None] | None = None, leading: bool = False):
    """The decoded chunk, or None (logged) when the blob cannot stand for this chunk.

    shape: (layers, kv_heads, any, head_dim) of the model's K/V. same_position: the blob must have been
    computed at `start` (a prefix hit); False for a content hit, whose keys are re-rotated. rope: None
    refuses blobs whose keys are stored un-rotated (nothing could rotate them into place). device: where
    the tensors are decoded (dequantized): the buffers' device. borrow: the tensors may share the blob's
    read-only memory (placed before the blob goes away). on_corrupt(key): told of a blob that fails its
    checksum, does not decode or decodes to NaN or infinity, so the store can drop it. The header's size
    and shape are checked before anything is decoded, allocated or copied to the device. leading: the blob may
    hold more tokens than num_tokens (a continuation sharing its first num_tokens with the prompt): only
    those leading tokens are returned.
    """
    kind = "chunk" if same_position else "content hit"
    if blob is None or key != expected_key:
        logger.info("%s at position %d missing at fetch (evicted since lookup?)", kind, start)
        return None
    expected = (shape[0], shape[1], num_tokens, shape[3])
    try:
        # Size and shape from the 48-byte header first: nothing is allocated or copied for a blob that
        # cannot stand for this chunk, whatever dims its header claims.
        header = read_header(blob)
        if leading and len(header.shape) == 4 and header.shape[2] >= num_tokens > 0:
            expected = (shape[0], shape[1], header.shape[2], shape[3])
        if header.shape != expected or (same_position and header.start_position != start):
            raise UnexpectedShape(f"shape {header.shape} at {header.start_position}, expected {expected} at {start}")
        if header.keys_before_rope and rope is None:
            logger.warning("%s at position %d stores its keys un-rotated and this model's RoPE cannot rotate them: "
                           "recomputing it", kind, start)
            return None
        decoded = decode_chunk(blob, device=device, verify=verify, borrow=borrow, expected_shape=expected,
                               check_finite=True)
        if expected[2] != num_tokens:  # a longer continuation: its first num_tokens tokens' K/V are exact here
            decoded = dataclasses.replace(decoded, keys=decoded.keys[:, :, :num_tokens],
                                          values=decoded.values[:, :, :num_tokens])
        return decoded
    except UnexpectedShape as error:
        logger.warning("%s at position %d has %s: recomputing it", kind, start, error)
        return None
    except BlobError as error:  # truncated, failed checksum, NaN or infinity: corrupt, dropped from the store
        logger.warning("%s at position %d could not be decoded, recomputing it: %s", kind, start, error)
        if on_corrupt is not None:
            on_corrupt(key)
        return None


def place_hit_(key_target: torch.Tensor, value_target: torch.Tensor, decoded: DecodedChunk, start: int,
               rope: RopeParams | None) -> bool:
    """Puts a decoded chunk into buffer slices (targets: [layers, kv_heads, n, head_dim]) at positions start..;
    False (logged) when its keys cannot be rotated there, and the slices are then not to be used."""
    if not place_rotated_keys_(key_target, decoded, start, rope):
        return False
    value_target.copy_(decoded.values)
    return True


def place_rotated_keys_(target: torch.Tensor, decoded: DecodedChunk, start: int, rope: RopeParams | None) -> bool:
    """Puts the decoded keys into `target` (a buffer slice) rotated to positions start.., from the positions
    they are stored for (start_position.., or 0 for every token when stored un-rotated). False (logged)
    when the RoPE refuses the move; target's rows are then not to be used.
    """
    header, keys = decoded.header, decoded.keys
    if not header.keys_before_rope and header.start_position == start:
        target.copy_(keys)
        return True
    assert rope is not None, "decode_hit refuses blobs that need rotation without rope parameters"
    to_positions = torch.arange(start, start + target.shape[2], device=target.device)
    from_positions = torch.zeros_like(to_positions) if header.keys_before_rope else to_positions - start + header.start_position
    try:
        if header.bits != 16 and keys.dtype != target.dtype:
            # Dequantized in float32 (see writeback): rotated there, then rounded into the buffer once. The
            # tensor is dequantize's own, never the blob's memory.
            rerotate_keys_(keys, from_positions, to_positions, rope)
            target.copy_(keys)
        else:  # in place in the buffer: no copy beside it
            target.copy_(keys)
            rerotate_keys_(target, from_positions, to_positions, rope)
    except UnsupportedRope as error:
        logger.info("chunk at position %d not reused: %s", start, error)
        return False
    return True
