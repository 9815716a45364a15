"""KIVI-style group quantization of K/V: keys per channel (asymmetric), values per token (asymmetric or
symmetric); torch maths only."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (8, 4)
SCALE_DTYPE = torch.float16  # scale and zero point are stored as float16, as in KIVI
_AXES = ("channel", "token")


@dataclass(slots=True, frozen=True)
class QuantizedTensor:
    """A quantized K or V tensor.

    data:  uint8 [ceil(numel * bits / 8)], the integer codes of `shape` in row-major order; at 4 bits
           two codes per byte, the even element in the low nibble.
    scale, zero: float16. axis "channel" (keys): [..., num_token_groups, channels], one pair per
           channel per group of `group_size` consecutive tokens. axis "token" (values):
           [..., tokens, num_channel_groups], one pair per token per group of `group_size` channels.
    Asymmetric (zero is a tensor): a code c stands for c * scale + zero.
    Symmetric (zero is None): a code c stands for (c - 2**(bits-1)) * scale; codes run from 1 to
           2**bits - 1, so the grid is symmetric around 0 and only the scale is stored.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    group_size: int
    axis: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.bits in SUPPORTED_BITS, f"bits must be one of {SUPPORTED_BITS}, got {self.bits}"
        assert self.group_size > 0, f"group_size must be positive, got {self.group_size}"
        assert self.axis in _AXES, f"axis must be one of {_AXES}, got {self.axis!r}"
        assert len(self.shape) >= 2, f"a quantized tensor has at least 2 dims, got shape {self.shape}"
        assert self.data.dtype == torch.uint8, f"data must be uint8, got {self.data.dtype}"
        expected = packed_num_bytes(num_elements(self.shape), self.bits)
        assert self.data.numel() == expected, f"data holds {self.data.numel()} bytes, shape needs {expected}"
        scale_shape = scale_shape_for(self.shape, self.group_size, self.axis)
        assert tuple(self.scale.shape) == scale_shape, f"scale shape {tuple(self.scale.shape)} != {scale_shape}"
        assert self.zero is None or tuple(self.zero.shape) == scale_shape, f"zero shape {tuple(self.zero.shape)} != {scale_shape}"

    @property
    def symmetric(self) -> bool:
        return self.zero is None


def num_elements(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def packed_num_bytes(num_codes: int, bits: int) -> int:
    return (num_codes * bits + 7) // 8


def scale_shape_for(shape: tuple[int, ...], group_size: int, axis: str) -> tuple[int, ...]:
    """Shape of the scale (and zero) tensor of a tensor of `shape` quantized along `axis`."""
    *batch, num_tokens, num_channels = shape
    if axis == "channel":
        return (*batch, _num_groups(num_tokens, group_size), num_channels)
    return (*batch, num_tokens, _num_groups(num_channels, group_size))


def quantize_keys(keys: torch.Tensor, bits: int, group_size: int) -> QuantizedTensor:
    """Per channel: each channel gets a scale/zero per group of `group_size` consecutive tokens.

    keys: [..., tokens, channels], e.g. [layers, kv_heads, tokens, head_dim]. Key outliers sit in
    fixed channels, so grouping along tokens keeps them from inflating the other channels' scales.
    """
    # by_channel: [..., channels, tokens]
    codes, scale, zero = _quantize_last_axis(keys.transpose(-1, -2), bits, group_size)
    data = _pack(codes.transpose(-1, -2), bits)
    return QuantizedTensor(data, scale.transpose(-1, -2), zero.transpose(-1, -2), bits, group_size, "channel", tuple(keys.shape))


def quantize_values(values: torch.Tensor, bits: int, group_size: int, symmetric: bool = False) -> QuantizedTensor:
    """Per token: each token gets a scale/zero per group of `group_size` consecutive channels.

    values: [..., tokens, channels]. Attention mixes value rows token by token, so per-token
    error stays local to that token's weight. symmetric: a scale only (values centre on 0), half the
    per-token overhead of scale and zero.
    """
    codes, scale, zero = _quantize_last_axis(values, bits, group_size, symmetric)
    return QuantizedTensor(_pack(codes, bits), scale, zero, bits, group_size, "token", tuple(values.shape))


def dequantize(quantized: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `quantized.shape` in `dtype`, on the device of `quantized.data`."""
    codes = _unpack(quantized.data, quantized.bits, num_elements(quantized.shape)).view(quantized.shape)
    scale = quantized.scale.float()
    if quantized.symmetric:
        zero = scale * -float(2 ** (quantized.bits - 1))  # code c stands for (c - 2**(bits-1)) * scale
    else:
        zero = quantized.zero.float()
    if quantized.axis == "channel":
        # codes: [..., tokens, channels]; scale: [..., token_groups, channels]
        num_tokens = quantized.shape[-2]
        scale = scale.repeat_interleave(quantized.group_size, dim=-2)[..., :num_tokens, :]
        zero = zero.repeat_interleave(quantized.group_size, dim=-2)[..., :num_tokens, :]
    else:
        # codes: [..., tokens, channels]; scale: [..., tokens, channel_groups]
        num_channels = quantized.shape[-1]
        scale = scale.repeat_interleave(quantized.group_size, dim=-1)[..., :num_channels]
        zero = zero.repeat_interleave(quantized.group_size, dim=-1)[..., :num_channels]
    return torch.addcmul(zero, codes.float(), scale).to(dtype)


def _num_groups(length: int, group_size: int) -> int:
    return -(-length // group_size)


def _quantize_last_axis(
    x: torch.Tensor, bits: int, group_size: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Min/max (asymmetric) or abs-max (symmetric) quantization in groups along the last axis.

    x: [..., n] -> codes uint8 [..., n], scale and zero float16 [..., ceil(n / group_size)]
    (zero None when symmetric).
    """
    assert bits in SUPPORTED_BITS, f"bits must be one of {SUPPORTED_BITS}, got {bits}"
    assert group_size > 0, f"group_size must be positive, got {group_size}"
    assert x.dim() >= 2 and x.shape[-1] > 0, f"cannot quantize a tensor of shape {tuple(x.shape)}"
    max_code = 2**bits - 1
    length = x.shape[-1]
    num_groups = _num_groups(length, group_size)
    x = x.float()
    padding = num_groups * group_size - length
    if padding:
        # Repeating the last element leaves every group's min and max unchanged.
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], padding)], dim=-1)
    groups = x.reshape(*x.shape[:-1], num_groups, group_size)  # [..., groups, group_size]
    if symmetric:
        return _quantize_symmetric(groups, bits, length)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    zero = _round_half(low, toward=float("-inf"))
    scale = _round_half(((high - zero.float()) / max_code).clamp_min(torch.finfo(SCALE_DTYPE).tiny), toward=float("inf"))
    if not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
        raise ValueError("values beyond the float16 range cannot be quantized (scale/zero are float16)")
    # zero <= low and zero + max_code * scale >= high, both in float16, so codes never clip.
    codes = ((groups - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round_().clamp_(0, max_code)
    codes = codes.to(torch.uint8).reshape(*x.shape[:-1], num_groups * group_size)[..., :length]
    return codes, scale, zero


def _quantize_symmetric(groups: torch.Tensor, bits: int, length: int) -> tuple[torch.Tensor, torch.Tensor, None]:
    """groups: [..., num_groups, group_size] float32 -> codes uint8 [..., length], scale float16, None."""
    half = 2 ** (bits - 1) - 1  # codes 1 .. 2*half+1 stand for -half .. half steps
    absmax = groups.abs().amax(dim=-1)
    scale = _round_half((absmax / half).clamp_min(torch.finfo(SCALE_DTYPE).tiny), toward=float("inf"))
    if not torch.isfinite(scale).all():
        raise ValueError("values beyond the float16 range cannot be quantized (scales are float16)")
    # half * scale >= absmax in float16, so codes never clip.
    codes = (groups / scale.float().unsqueeze(-1)).round_().clamp_(-half, half).add_(half + 1)
    codes = codes.to(torch.uint8).reshape(*groups.shape[:-2], -1)[..., :length]
    return codes, scale, None


def _round_half(x: torch.Tensor, toward: float) -> torch.Tensor:
    """x as float16, rounded in the direction of `toward` (so the range stays covered)."""
    rounded = x.to(SCALE_DTYPE)
    wrong_side = rounded.float() > x if toward < 0 else rounded.float() < x
    return torch.where(wrong_side, torch.nextafter(rounded, torch.full_like(rounded, toward)), rounded)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of any shape -> flat uint8 bytes; at 4 bits two codes per byte, even one low."""
    flat = codes.contiguous().view(-1)
    if bits == 8:
        return flat
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack(data: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """Flat uint8 bytes -> flat uint8 codes of length num_codes."""
    if bits == 8:
        return data[:num_codes]
    pairs = torch.stack([data & 0x0F, data >> 4], dim=-1)  # [bytes, 2]
    return pairs.view(-1)[:num_codes]
