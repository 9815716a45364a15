"""Test factories: tiny seeded models are deterministic, the byte tokenizer round-trips text."""
from __future__ import annotations

import pytest
import torch

from tests.factories import build_byte_tokenizer, build_tiny_model

PROMPT_IDS = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 119]])


def logits_of(model, input_ids: torch.Tensor = PROMPT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_same_seed_builds_the_same_model(kind):
    first, _ = build_tiny_model(kind, seed=0)
    second, _ = build_tiny_model(kind, seed=0)
    assert torch.equal(logits_of(first), logits_of(second))
    other, _ = build_tiny_model(kind, seed=1)
    assert not torch.equal(logits_of(first), logits_of(other))


@pytest.mark.parametrize("fixture_name, model_type", [("tiny_llama", "llama"), ("tiny_qwen2", "qwen2")])
def test_tiny_models_are_two_layer_fp32_eval_models(request, fixture_name, model_type):
    model, tokenizer = request.getfixturevalue(fixture_name)
    assert model.config.model_type == model_type
    assert model.config.num_hidden_layers == len(model.model.layers) == 2
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    assert model.config.vocab_size == len(tokenizer) == 260
    assert not model.training
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    # The session fixture holds the seed-0 weights.
    assert torch.equal(logits_of(model), logits_of(build_tiny_model(model_type, seed=0)[0]))


@pytest.mark.parametrize("text", ["Hello, world.", "  two  spaces\nand a newline", "héllo wörld ✓ 漢字", ""])
def test_byte_tokenizer_round_trips_text(text):
    tokenizer = build_byte_tokenizer()
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(token_ids) == len(text.encode("utf-8"))  # one token per byte
    assert all(0 <= token_id < 256 for token_id in token_ids)
    assert tokenizer.decode(token_ids) == text


def test_byte_tokenizer_specials_and_chat_template():
    tokenizer = build_byte_tokenizer()
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]) == [256, 257, 258, 259]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (258, 259)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert token_ids[0] == 257 and tokenizer.decode(token_ids) == text
