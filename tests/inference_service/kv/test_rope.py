"""Tests for inference_service/rope.py: re-rotated keys equal the keys the model computes at the new positions."""
from __future__ import annotations

import pytest
import torch

from inference_service.kv.rope import RopeParams, UnsupportedRope, rerotate_keys, rope_parameters
from tests.factories import build_byte_tokenizer, tiny_config

# Scaled variants as model configs declare them; each is checked against the model built from it.
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
_LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
_DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}


def make_model(kind: str = "llama", rope: dict | None = None):
    """A tiny seeded fp32 model; `rope` replaces the config's rope_parameters."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, vocab_size=len(build_byte_tokenizer()))
    if rope is not None:
        config.rope_parameters = dict(rope)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def keys_at(model, input_ids: torch.Tensor, start: int) -> torch.Tensor:
    """Keys of all layers for input_ids run alone at positions start.. -> [layers, kv_heads, tokens, head_dim]."""
    positions = torch.arange(start, start + input_ids.shape[1])[None]
    with torch.no_grad():
        cache = model(input_ids, position_ids=positions, use_cache=True).past_key_values
    return torch.stack([layer.keys[0] for layer in cache.layers])


def assert_rerotation_matches_model(model, start: int = 0, target: int = 357, num_tokens: int = 24) -> None:
    torch.manual_seed(1)
    chunk = torch.randint(0, 256, (1, num_tokens))
    # The chunk has no left context, so only its positions differ between the two runs.
    stored, fresh = keys_at(model, chunk, start), keys_at(model, chunk, target)
    params = rope_parameters(model.config)
    from_positions = torch.arange(start, start + num_tokens)
    moved = rerotate_keys(stored, from_positions, from_positions + (target - start), params)
    assert not torch.allclose(stored, fresh, atol=1e-3), "the positions must change the keys for the test to mean anything"
    torch.testing.assert_close(moved, fresh, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_rerotated_keys_equal_fresh_keys(kind):
    assert_rerotation_matches_model(make_model(kind))


@pytest.mark.parametrize("rope", [_LLAMA3, _LINEAR, _YARN], ids=["llama3", "linear", "yarn"])
def test_rerotated_keys_equal_fresh_keys_with_scaled_rope(rope):
    model = make_model("llama", rope)
    params = rope_parameters(model.config)
    # The parameters are the model's own: scaled frequencies, and yarn's attention factor.
    torch.testing.assert_close(params.inv_freq, model.model.rotary_emb.inv_freq, atol=0, rtol=0)
    assert params.attention_scaling == pytest.approx(model.model.rotary_emb.attention_scaling)
    assert params.rope_type == rope["rope_type"]
    assert_rerotation_matches_model(model)


def test_yarn_scaling_is_not_applied_twice():
    params = rope_parameters(make_model("llama", _YARN).config)
    # yarn's cos/sin carry a factor > 1; a rotation by Δ must keep the norm of every key.
    assert params.attention_scaling > 1.0
    keys = torch.randn(2, 3, 5, 16)
    moved = rerotate_keys(keys, torch.arange(5), torch.arange(5) + 40, params)
    torch.testing.assert_close(moved.norm(dim=-1), keys.norm(dim=-1))


def test_moving_backwards_and_to_a_later_stored_position():
    # A chunk stored at 300.. and placed at 40..: Δ is negative.
    assert_rerotation_matches_model(make_model("qwen2"), start=300, target=40)


def test_dynamic_rope_is_exact_below_its_base_length_and_refused_beyond():
    model = make_model("llama", _DYNAMIC)
    params = rope_parameters(model.config)
    assert params.max_exact_position == model.config.max_position_embeddings == 4096
    assert "dynamic" in params.note
    assert_rerotation_matches_model(model)
    keys = torch.randn(1, 2, 3, 16)
    with pytest.raises(UnsupportedRope, match="out of range"):
        rerotate_keys(keys, torch.arange(3), torch.arange(3) + 4094, params)


def test_unknown_rope_type_is_refused():
    config = make_model("llama").config
    config.rope_parameters = {"rope_type": "made-up", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedRope, match="made-up"):
        rope_parameters(config)


def test_models_with_layers_that_skip_rope_are_refused():
    """SmolLM3 leaves every 4th layer without RoPE (NoPE): one rotation for all layers would corrupt those keys."""
    from transformers import SmolLM3Config

    with pytest.raises(UnsupportedRope, match=r"layers \[3, 7\] use no RoPE"):
        rope_parameters(SmolLM3Config(num_hidden_layers=8))
    assert rope_parameters(SmolLM3Config(num_hidden_layers=8, no_rope_layers=[1] * 8)).rope_type == "default"


def test_rotations_compose_and_invert():
    params = RopeParams(inv_freq=1.0 / (10000 ** (torch.arange(0, 16, 2) / 16)), attention_scaling=1.0,
                        rope_type="default")
    keys = torch.randn(3, 2, 7, 16, dtype=torch.float64)
    positions = torch.arange(7) * 11
    # R(b - a) R(a - 0) == R(b - 0), and R(0 - b) undoes R(b - 0).
    step = rerotate_keys(rerotate_keys(keys, positions, positions + 5, params), positions + 5, positions + 130, params)
    torch.testing.assert_close(step, rerotate_keys(keys, positions, positions + 130, params))
    torch.testing.assert_close(rerotate_keys(step, positions + 130, positions, params), keys)


def test_partial_rotary_passes_the_other_dims_through():
    # inv_freq of 4 frequencies rotates the first 8 of 16 dims, as Phi-3 / NeoX partial rotary does.
    params = RopeParams(inv_freq=torch.tensor([1.0, 0.1, 0.01, 0.001]), attention_scaling=1.0, rope_type="default")
    keys = torch.randn(1, 2, 4, 16)
    moved = rerotate_keys(keys, torch.zeros(4, dtype=torch.long), torch.arange(4) + 3, params)
    assert torch.equal(moved[..., 8:], keys[..., 8:])
    assert not torch.allclose(moved[..., :8], keys[..., :8])
    assert moved.shape == keys.shape and moved.dtype == keys.dtype


def test_half_precision_keys_are_rotated_in_float32():
    params = RopeParams(inv_freq=1.0 / (10000 ** (torch.arange(0, 16, 2) / 16)), attention_scaling=1.0,
                        rope_type="default")
    keys = torch.randn(2, 3, 9, 16).to(torch.bfloat16)
    from_positions, to_positions = torch.arange(9), torch.arange(9) + 1000
    exact = rerotate_keys(keys.float(), from_positions, to_positions, params)
    moved = rerotate_keys(keys, from_positions, to_positions, params)
    assert moved.dtype == torch.bfloat16
    # Only the final rounding to bfloat16 remains: within one bf16 step of the float32 result.
    torch.testing.assert_close(moved.float(), exact, atol=0, rtol=2 ** -8)
