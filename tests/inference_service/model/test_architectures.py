"""Architecture check: supported RoPE decoders pass, ALiBi / learned positions / partial rotary are refused."""
from __future__ import annotations

import pytest
from transformers import (
    BioGptConfig, BloomConfig, FalconConfig, GPT2Config, GPTBigCodeConfig, GPTJConfig, GPTNeoXConfig, Gemma2Config,
    LlamaConfig, MistralConfig, MptConfig, OPTConfig, PersimmonConfig, Phi3Config, PhiConfig, Qwen2Config,
    Qwen3Config, StableLmConfig, T5Config,
)

from inference_service.model.architectures import REFUSED_MODEL_TYPES, check_architecture, inspect_architecture
from inference_service.errors import UnsupportedArchitecture


@pytest.mark.parametrize("config_class", [LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Gemma2Config, Phi3Config])
def test_rope_decoders_are_supported(config_class):
    check = check_architecture(config_class())
    assert check.supported and check.reason == ""


@pytest.mark.parametrize("config_class, reason", [
    (GPT2Config, "learned absolute position"),
    (BloomConfig, "ALiBi"),
    (MptConfig, "ALiBi"),
    (FalconConfig, "ALiBi"),
    (GPTNeoXConfig, "partial rotary"),
    (OPTConfig, "learned absolute position"),
    (GPTBigCodeConfig, "learned absolute position"),
    (BioGptConfig, "learned absolute position"),
    (GPTJConfig, "partial rotary"),
    (PhiConfig, "partial rotary"),
    (StableLmConfig, "partial rotary"),
    (PersimmonConfig, "partial rotary"),
    (T5Config, "encoder-decoder"),
])
def test_refused_architectures_name_the_reason(config_class, reason, tmp_path):
    with pytest.raises(UnsupportedArchitecture, match=reason) as raised:
        check_architecture(config_class())
    assert "--no-strict" in str(raised.value)
    if config_class is T5Config:
        return
    # The same config as a checkpoint directory (config only, no weights) is refused by load_model too.
    from inference_service.model.loading import load_model

    config_class(num_hidden_layers=1, hidden_size=8, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitecture, match=reason):
        load_model(str(tmp_path))


def test_every_refused_type_is_tested():
    tested = {config_class.model_type for config_class in (
        GPT2Config, BloomConfig, MptConfig, FalconConfig, GPTNeoXConfig, OPTConfig, GPTBigCodeConfig, BioGptConfig,
        GPTJConfig, PhiConfig, StableLmConfig, PersimmonConfig)}
    assert tested == set(REFUSED_MODEL_TYPES)


def test_not_strict_returns_the_refusal_instead_of_raising():
    check = check_architecture(GPT2Config(), strict=False)
    assert not check.supported and "learned absolute position" in check.reason
    assert check.model_type == "gpt2"


def test_partial_rotary_on_a_listed_type_is_refused():
    config = LlamaConfig()
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    assert "partial rotary" in inspect_architecture(config).reason


def test_unknown_model_type_is_refused_with_the_supported_list():
    class OddConfig:
        model_type = "odd"
        architectures = ["OddForCausalLM"]

    check = inspect_architecture(OddConfig())
    assert not check.supported and check.architecture == "OddForCausalLM" and "llama" in check.reason


def test_architecture_name_comes_from_the_config():
    config = LlamaConfig(architectures=["LlamaForCausalLM"])
    assert inspect_architecture(config).architecture == "LlamaForCausalLM"


def test_load_model_refuses_before_reading_weights(tmp_path):
    from inference_service.model.loading import load_model

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)  # a config, no weights at all
    with pytest.raises(UnsupportedArchitecture, match="GPT2|gpt2"):
        load_model(str(tmp_path))
