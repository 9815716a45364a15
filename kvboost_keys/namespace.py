"""The cache namespace: one digest over everything that makes two chunks' K/V bytes incompatible."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import NewType

# Seeds both chains; different models, precisions or tenants never share a key.
Namespace = NewType("Namespace", bytes)


# Config entries that describe how a model was saved or is run, not what it computes.
_RUNTIME_CONFIG_KEYS = frozenset({
    "transformers_version", "dtype", "torch_dtype", "use_cache", "return_dict",
    "output_attentions", "output_hidden_states",
})


def canonical_json(value: object) -> str:
    """JSON with sorted keys and no whitespace, so equal configs give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def dtype_name(dtype) -> str:
    """'float32' for torch.float32: the dtype as the namespace names it."""
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
class NamespaceSpec:
    """Everything that makes two chunks' K/V bytes incompatible."""

    weights_id: str  # a fingerprint of the weights (never the name they were asked for by)
    config_json: str  # canonical JSON of the model config (see canonical_json)
    dtype: str
    tokenizer_id: str
    chunk_size: int
    kv_cache_bits: int
    format_version: int
    tenant_salt: str = ""
    prefill: str = ""  # "" (the default prefill: left out of the digest, so its namespaces never moved) or "invariant"

    def __post_init__(self) -> None:
        assert self.chunk_size > 0, f"chunk_size must be positive, got {self.chunk_size}"
        assert self.kv_cache_bits in (4, 8, 16), f"kv_cache_bits must be 4, 8 or 16, got {self.kv_cache_bits}"


def namespace_digest(spec: NamespaceSpec) -> Namespace:
    fields = asdict(spec)
    if not fields["prefill"]:
        del fields["prefill"]
    return Namespace(hashlib.sha256(canonical_json(fields).encode()).digest())


def salted_namespace(namespace: Namespace, cache_salt: str) -> Namespace:
    """A request's namespace: SHA-256(namespace ‖ salt), so requests with different salts share no chunk.

    An empty salt leaves the namespace (and so every key) unchanged.
    """
    if not cache_salt:
        return namespace
    return Namespace(hashlib.sha256(namespace + cache_salt.encode()).digest())
