"""KIVI quantization: error bounds, int4 packing, and the axes (keys per channel, values per token)."""
from __future__ import annotations

import pytest
import torch

from inference_service.kv.quant import QuantizedTensor, dequantize, quantize_keys, quantize_values


def make_tensor(shape=(2, 3, 37, 16), seed=0, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 3 + 1).to(dtype)


def channel_scaled(num_tokens=16, num_channels=4, seed=0) -> torch.Tensor:
    """[1, 1, tokens, channels] where channel c has magnitude ~10**c (key outlier channels)."""
    magnitudes = 10.0 ** torch.arange(num_channels)
    return make_tensor((1, 1, num_tokens, num_channels), seed) * magnitudes


def token_scaled(num_tokens=16, num_channels=4, seed=0) -> torch.Tensor:
    """[1, 1, tokens, channels] where token t has magnitude ~10**(t % 4) (value outlier tokens)."""
    magnitudes = 10.0 ** (torch.arange(num_tokens) % 4).float()
    return make_tensor((1, 1, num_tokens, num_channels), seed) * magnitudes[:, None]


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor, dim: int) -> float:
    """The worst over slices along `dim` of max |error| / max |value| within the slice."""
    other_dims = [d for d in range(expected.dim()) if d != dim % expected.dim()]
    error = (actual - expected).abs().amax(dim=other_dims)
    return (error / expected.abs().amax(dim=other_dims)).max().item()


# --- error bounds ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_key_error_is_at_most_half_a_step_per_channel_group(bits):
    keys = make_tensor()  # 37 tokens in groups of 8: the last group holds 5
    quantized = quantize_keys(keys, bits, group_size=8)
    restored = dequantize(quantized, torch.float32)
    max_code = 2**bits - 1
    for group in range(5):
        tokens = slice(group * 8, (group + 1) * 8)
        scale, zero = quantized.scale[:, :, group, :].float(), quantized.zero[:, :, group, :].float()  # [2, 3, 16]
        low, high = keys[:, :, tokens, :].amin(dim=2), keys[:, :, tokens, :].amax(dim=2)
        # The step just covers the group's range (scale is float16, rounded up; zero rounded down).
        assert (zero <= low).all() and (zero + max_code * scale >= high).all()
        assert torch.allclose(scale, (high - low) / max_code, rtol=2e-3)
        error = (restored[:, :, tokens, :] - keys[:, :, tokens, :]).abs()
        assert (error <= scale[:, :, None, :] / 2 + 1e-5).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_value_error_is_at_most_half_a_step_per_token_group(bits):
    values = make_tensor(shape=(2, 3, 5, 20))  # 20 channels in groups of 8: the last group holds 4
    quantized = quantize_values(values, bits, group_size=8)
    restored = dequantize(quantized, torch.float32)
    max_code = 2**bits - 1
    for group in range(3):
        channels = slice(group * 8, (group + 1) * 8)
        scale = quantized.scale[..., group].float()  # [2, 3, 5]
        low, high = values[..., channels].amin(dim=-1), values[..., channels].amax(dim=-1)
        assert torch.allclose(scale, (high - low) / max_code, rtol=2e-3)
        error = (restored[..., channels] - values[..., channels]).abs()
        assert (error <= scale[..., None] / 2 + 1e-5).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_symmetric_value_error_is_at_most_half_a_step_per_token_group(bits):
    values = make_tensor(shape=(2, 3, 5, 20))  # 20 channels in groups of 8: the last group holds 4
    quantized = quantize_values(values, bits, group_size=8, symmetric=True)
    assert quantized.symmetric and quantized.zero is None
    restored = dequantize(quantized, torch.float32)
    half = 2 ** (bits - 1) - 1
    codes = quantized.data if bits == 8 else torch.stack([quantized.data & 0x0F, quantized.data >> 4], -1).view(-1)
    assert int(codes[: values.numel()].min()) >= 1 and int(codes.max()) <= 2 * half + 1  # code 0 unused
    for group in range(3):
        channels = slice(group * 8, (group + 1) * 8)
        scale = quantized.scale[..., group].float()  # [2, 3, 5]
        absmax = values[..., channels].abs().amax(dim=-1)
        # The grid -half..half steps just covers the group's abs-max (scale float16, rounded up).
        assert (half * scale >= absmax).all()
        assert torch.allclose(scale, absmax / half, rtol=2e-3)
        error = (restored[..., channels] - values[..., channels]).abs()
        assert (error <= scale[..., None] / 2 + 1e-5).all()


def test_symmetric_values_keep_zero_and_signs_exact():
    values = torch.tensor([[[[0.0, 1.0, -1.0, 0.5, -0.25, 0.0, 2.0, -2.0]]]])
    restored = dequantize(quantize_values(values, 8, group_size=8, symmetric=True), torch.float32)
    assert restored[..., 0].item() == 0.0 and restored[..., 5].item() == 0.0
    assert restored[..., 6].item() == -restored[..., 7].item() >= 2.0  # +-absmax land on the grid's two ends
    assert torch.equal(restored.sign(), values.sign())


def test_symmetric_scale_costs_half_the_asymmetric_scale_and_zero():
    values = make_tensor(shape=(2, 3, 5, 16))
    asymmetric = quantize_values(values, 8, group_size=8)
    symmetric = quantize_values(values, 8, group_size=8, symmetric=True)
    assert symmetric.scale.shape == asymmetric.scale.shape and symmetric.zero is None
    assert symmetric.data.numel() == asymmetric.data.numel()


def test_scale_and_zero_shapes_encode_the_axis():
    tensor = make_tensor(shape=(2, 3, 37, 16))
    keys = quantize_keys(tensor, bits=8, group_size=8)
    values = quantize_values(tensor, bits=8, group_size=8)
    # keys: one scale per channel per group of 8 tokens (ceil(37 / 8) = 5 groups)
    assert (keys.axis, tuple(keys.scale.shape), tuple(keys.zero.shape)) == ("channel", (2, 3, 5, 16), (2, 3, 5, 16))
    # values: one scale per token per group of 8 channels (16 / 8 = 2 groups)
    assert (values.axis, tuple(values.scale.shape), tuple(values.zero.shape)) == ("token", (2, 3, 37, 2), (2, 3, 37, 2))
    assert keys.scale.dtype == values.zero.dtype == torch.float16
    assert keys.shape == values.shape == (2, 3, 37, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_returns_the_requested_dtype(dtype):
    tensor = make_tensor(dtype=dtype)
    restored = dequantize(quantize_keys(tensor, 8, 32), dtype)
    assert restored.dtype == dtype and restored.shape == tensor.shape
    assert (restored.float() - tensor.float()).abs().max() < 0.15  # range ~24 / 255 / 2, plus rounding to dtype


def test_constant_groups_reconstruct_exactly():
    tensor = torch.full((1, 2, 9, 4), 2.5)
    for quantize in (quantize_keys, quantize_values):
        restored = dequantize(quantize(tensor, 4, 4), torch.float32)
        assert torch.equal(restored, tensor)


def test_values_beyond_the_float16_range_are_refused():
    tensor = make_tensor(shape=(1, 1, 4, 4)) * 1e6
    with pytest.raises(ValueError, match="float16 range"):
        quantize_keys(tensor, 8, 4)


# --- int4 packing ------------------------------------------------------------------------------


def test_int4_codes_are_packed_two_per_byte_low_nibble_first():
    # Every group holds 0 and 15, so scale is 1, zero is 0 and each value is its own code.
    codes = torch.tensor([[0, 15, 1, 2, 3], [15, 0, 4, 5, 6], [7, 8, 15, 0, 9]], dtype=torch.float32)
    tensor = codes.view(1, 1, 3, 5)  # 15 elements: an odd count, the last byte half used
    quantized = quantize_values(tensor, bits=4, group_size=5)
    assert quantized.data.dtype == torch.uint8 and quantized.data.numel() == 8
    assert quantized.data.tolist()[:3] == [0 | 15 << 4, 1 | 2 << 4, 3 | 15 << 4]
    assert quantized.data.tolist()[-1] == 9  # the 15th code alone in the low nibble
    assert torch.equal(dequantize(quantized, torch.float32), tensor)


@pytest.mark.parametrize("bits, num_bytes", [(8, 2 * 3 * 37 * 16), (4, 2 * 3 * 37 * 16 // 2)])
def test_packed_data_size(bits, num_bytes):
    quantized = quantize_keys(make_tensor(), bits, group_size=8)
    assert tuple(quantized.data.shape) == (num_bytes,)


def test_int4_pack_round_trips_all_sixteen_codes():
    # Codes 0..15 in every position of a byte pair, one per-token group of 16 channels.
    codes = torch.stack([torch.arange(16).roll(shift) for shift in range(16)]).float()  # [16 tokens, 16]
    tensor = codes.view(1, 1, 16, 16)
    assert torch.equal(dequantize(quantize_values(tensor, bits=4, group_size=16), torch.float32), tensor)


# --- KIVI axes ---------------------------------------------------------------------------------


def test_keys_are_quantized_per_channel():
    keys = channel_scaled()  # channels of magnitude 1, 10, 100, 1000
    per_channel = dequantize(quantize_keys(keys, bits=8, group_size=4), torch.float32)
    # Every channel keeps its own scale: under 1% error relative to that channel's magnitude.
    assert max_relative_error(per_channel, keys, dim=-1) < 0.01
    # Grouping the same keys per token would share one scale across the channels: channel 0
    # (magnitude 1) would get steps of ~2000 / 255 and lose everything.
    per_token = dequantize(quantize_values(keys, bits=8, group_size=4), torch.float32)
    assert max_relative_error(per_token, keys, dim=-1) > 0.5


def test_values_are_quantized_per_token():
    values = token_scaled()  # tokens of magnitude 1, 10, 100, 1000, repeating
    per_token = dequantize(quantize_values(values, bits=8, group_size=4), torch.float32)
    assert max_relative_error(per_token, values, dim=-2) < 0.01
    # Grouping along tokens (the key layout) puts a magnitude-1 token beside a 1000 one.
    per_channel = dequantize(quantize_keys(values, bits=8, group_size=4), torch.float32)
    assert max_relative_error(per_channel, values, dim=-2) > 0.5


def test_quantized_tensor_checks_its_fields():
    quantized = quantize_keys(make_tensor(), 8, 8)
    with pytest.raises(AssertionError, match="bits must be one of"):
        QuantizedTensor(quantized.data, quantized.scale, quantized.zero, 3, 8, "channel", quantized.shape)
    with pytest.raises(AssertionError, match="scale shape"):
        QuantizedTensor(quantized.data, quantized.scale, quantized.zero, 8, 8, "token", quantized.shape)
    with pytest.raises(AssertionError, match="data holds"):
        QuantizedTensor(quantized.data[:-1], quantized.scale, quantized.zero, 8, 8, "channel", quantized.shape)


def test_a_smollm2_sized_chunk_quantizes():
    # [30 layers, 3 kv_heads, 128 tokens, 64]: SmolLM2-135M's K for one 128-token chunk.
    keys = make_tensor(shape=(30, 3, 128, 64))
    quantized = quantize_keys(keys, 8, 32)
    assert tuple(quantized.scale.shape) == (30, 3, 4, 64)
    assert (dequantize(quantized, torch.float32) - keys).abs().max() < 0.1
