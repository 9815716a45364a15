"""All device work on the model: loading, the forward passes, and DynamicCache in and out."""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from inference_service import model_loader
from inference_service.architectures import ArchitectureCheck, check_architecture
from inference_service.keys import canonical_json

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
# Config entries that describe how a model was saved or is run, not what it computes.
_RUNTIME_CONFIG_KEYS = frozenset({
    "transformers_version", "dtype", "torch_dtype", "use_cache", "return_dict",
    "output_attentions", "output_hidden_states",
})

# Per-layer K/V of the tokens one prefill computed: [(keys [1, kv_heads, n, head_dim], values)].
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True, frozen=True)
class LoadedModel:
    model: Any  # a transformers causal LM in eval mode
    tokenizer: Any
    model_id: str  # the name or path asked for; part of the cache namespace
    path: str  # where the weights were read from
    architecture: ArchitectureCheck


def pick_device_dtype(device: str | None = None, dtype: str | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA with bf16 (fp16 where bf16 is not supported) when present, else CPU fp32; explicit choices win."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen_device = torch.device(device)
    if chosen_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is present")
    if dtype is None:
        if chosen_device.type != "cuda":
            return chosen_device, torch.float32
        return chosen_device, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    return chosen_device, _DTYPES[dtype]


def load_model(name_or_path: str, device: str | None = None, dtype: str | None = None, strict: bool = True) -> LoadedModel:
    """Checks the architecture from the config first, then loads weights and tokenizer from disk.

    Raises:
        UnsupportedArchitecture: the config names an architecture chunk reuse is not sound for (strict only).
    """
    model_id = name_or_path or model_loader.DEFAULT_MODEL
    path = model_loader.resolve_model_path(name_or_path)
    architecture = check_architecture(AutoConfig.from_pretrained(path), strict=strict)
    chosen_device, chosen_dtype = pick_device_dtype(device, dtype)
    logger.info("loading %s from %s on %s as %s", model_id, path, chosen_device, chosen_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=chosen_dtype).to(chosen_device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model, tokenizer, model_id, path, architecture)


def prefer_gqa_attention(device: torch.device) -> None:
    """On CPU, lets SDPA group query heads itself even when a mask is given (a prefill after a cache hit).

    Without it transformers copies every cached K/V head per query group first (repeat_kv), which is
    most of the attention cost of a short suffix over a long cached prefix. The result is bit-identical
    on CPU (tests/test_engine.py checks it); CUDA keeps the default, where masked GQA can be slower.
    An explicit TRANSFORMERS_SDPA_FORCE_GQA in the environment wins.
    """
    if device.type == "cpu":
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def canonical_config_json(config) -> str:
    """The model config as canonical JSON, without names, paths and run-time flags."""
    values = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in _RUNTIME_CONFIG_KEYS}
    return canonical_json(values)


def tokenizer_identity(tokenizer) -> str:
    """Class, vocabulary size and a digest of the full tokenizer definition plus chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    definition += str(getattr(tokenizer, "chat_template", "") or "")
    digest = hashlib.sha256(definition.encode()).hexdigest()[:16]
    return f"{type(tokenizer).__name__}:{len(tokenizer)}:{digest}"


@dataclass(slots=True, frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int


def kv_geometry(config) -> KVGeometry:
    text = config.get_text_config(decoder=True)
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    return KVGeometry(text.num_hidden_layers, num_kv_heads, head_dim, int(text.max_position_embeddings))


def allocate_kv(geometry: KVGeometry, capacity: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized key and value buffers [layers, kv_heads, capacity, head_dim] for a whole request."""
    shape = (geometry.num_layers, geometry.num_kv_heads, capacity, geometry.head_dim)
    return torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer over a buffer with room for the tokens still to come.

    update() writes new K/V in place instead of concatenating, so neither the prefill after a cache hit
    nor a decode step copies the tokens already held. Views handed out earlier stay valid: positions
    below the current length are never written again.
    """

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, num_tokens: int) -> None:
        super().__init__()
        assert key_buffer.shape == value_buffer.shape and num_tokens <= key_buffer.shape[2], "buffers hold the tokens"
        self.dtype, self.device = key_buffer.dtype, key_buffer.device
        self.is_initialized = True
        self._key_buffer, self._value_buffer = key_buffer, value_buffer  # [1, kv_heads, capacity, head_dim]
        self._set_length(num_tokens)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._grow(end)
        self._key_buffer[:, :, start:end].copy_(key_states)
        self._value_buffer[:, :, start:end].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def _set_length(self, num_tokens: int) -> None:
        self.keys = self._key_buffer[:, :, :num_tokens]
        self.values = self._value_buffer[:, :, :num_tokens]

    def _grow(self, needed: int) -> None:
        length = self.keys.shape[-2]
        shape = list(self._key_buffer.shape)
        shape[2] = max(needed, 2 * shape[2])
        key_buffer, value_buffer = self._key_buffer.new_empty(shape), self._value_buffer.new_empty(shape)
        key_buffer[:, :, :length].copy_(self.keys)
        value_buffer[:, :, :length].copy_(self.values)
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self._set_length(length)


def build_cache(config, key_buffer: torch.Tensor, value_buffer: torch.Tensor, num_tokens: int) -> DynamicCache:
    """A DynamicCache holding the first num_tokens positions of the buffers, as if their prefill had just run.

    key_buffer, value_buffer: [layers, kv_heads, capacity, head_dim] on the model's device and dtype.
    Full-attention layers keep working inside the buffers (no copy); other layer kinds (sliding
    window) get the cached K/V through their own update().
    """
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        layer_keys, layer_values = key_buffer[index : index + 1], value_buffer[index : index + 1]
        if type(layer) is DynamicLayer:
            cache.layers[index] = PreallocatedLayer(layer_keys, layer_values, num_tokens)
        elif num_tokens:
            layer.update(layer_keys[:, :, :num_tokens], layer_values[:, :, :num_tokens])
    return cache


@torch.inference_mode()
def prefill(model, cache: DynamicCache, token_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, LayerKV]:
    """Runs the live tokens after `start` cached ones; returns the last token's logits and their K/V.

    token_ids: [n] at positions start .. start+n-1. Returns logits [vocab] (float32) and, per layer,
    the K/V of these n tokens (views; nothing later writes into them).
    """
    num_tokens = token_ids.shape[0]
    sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    for layer in sliding:  # keep every new token's K/V until they are read below
        layer.activate_past_recording()
    position_ids = torch.arange(start, start + num_tokens, device=token_ids.device).unsqueeze(0)
    output = model(
        input_ids=token_ids.unsqueeze(0), position_ids=position_ids, past_key_values=cache,
        use_cache=True, logits_to_keep=1,
    )
    new_kv = [(layer.keys[:, :, -num_tokens:], layer.values[:, :, -num_tokens:]) for layer in cache.layers]
    for layer in sliding:
        layer.record_past = False
        layer.keys = layer.keys[:, :, -layer.sliding_window + 1 :]
        layer.values = layer.values[:, :, -layer.sliding_window + 1 :]
    return output.logits[0, -1].float(), new_kv


@torch.inference_mode()
def decode_step(model, cache: DynamicCache, token_id: torch.Tensor, position: int) -> torch.Tensor:
    """One generated token through the model; token_id: [] at `position`. Returns logits [vocab] (float32)."""
    position_ids = torch.tensor([[position]], device=token_id.device)
    output = model(input_ids=token_id.view(1, 1), position_ids=position_ids, past_key_values=cache, use_cache=True)
    return output.logits[0, -1].float()


def stack_layers(new_kv: LayerKV, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [begin, end) of a prefill's per-layer K/V as keys, values: [layers, kv_heads, end-begin, head_dim]."""
    keys = torch.stack([layer_keys[0, :, begin:end] for layer_keys, _ in new_kv])
    values = torch.stack([layer_values[0, :, begin:end] for _, layer_values in new_kv])
    return keys, values
