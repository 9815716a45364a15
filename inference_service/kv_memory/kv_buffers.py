"""Per-request K/V buffers and the DynamicCache layers that write into them in place."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Per-layer K/V of the tokens one prefill computed: [(keys [1, kv_heads, n, head_dim], values)].
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


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
    nor a decode step copies the tokens already held. The buffer never grows (a slot holds the longest
    request); views handed out earlier stay valid: positions below the current length are never written again.
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
        assert end <= self._key_buffer.shape[-2], f"{end} tokens do not fit a slot of {self._key_buffer.shape[-2]}"
        self._key_buffer[:, :, start:end].copy_(key_states)
        self._value_buffer[:, :, start:end].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def truncate(self, num_tokens: int) -> None:
        """Holds the first num_tokens positions again (after a padded forward wrote past the real ones)."""
        assert num_tokens <= self.keys.shape[-2], f"cannot grow to {num_tokens} positions by truncating"
        self._set_length(num_tokens)

    def _set_length(self, num_tokens: int) -> None:
        self.keys = self._key_buffer[:, :, :num_tokens]
        self.values = self._value_buffer[:, :, :num_tokens]


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


def stack_layers(new_kv: LayerKV, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [begin, end) of a prefill's per-layer K/V as keys, values: [layers, kv_heads, end-begin, head_dim]."""
    keys = torch.stack([layer_keys[0, :, begin:end] for layer_keys, _ in new_kv])
    values = torch.stack([layer_values[0, :, begin:end] for _, layer_values in new_kv])
    return keys, values
