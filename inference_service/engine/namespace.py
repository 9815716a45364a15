"""The namespace an engine's chunks live under: everything that makes two engines' K/V bytes incompatible."""
from __future__ import annotations

from inference_service.kv import codec
from inference_service.engine_parts.types import EngineConfig
from kvboost_keys.namespace import (Namespace, NamespaceSpec, canonical_config_json, dtype_name, namespace_digest,
                                    tokenizer_identity)


def engine_namespace(model, tokenizer, config: EngineConfig, weights_id: str) -> Namespace:
    """Invariant prefill's K/V round apart from the default prefill's, so the two never share a chunk (a field of
    the spec, not a salt: no request's cache_salt can reach the other's namespace)."""
    spec = NamespaceSpec(weights_id=weights_id, config_json=canonical_config_json(model.config),
                         dtype=dtype_name(model.dtype), tokenizer_id=tokenizer_identity(tokenizer),
                         chunk_size=config.chunk_size, kv_cache_bits=config.kv_cache_bits,
                         format_version=codec.BLOB_FORMAT_VERSION, tenant_salt=config.tenant_salt,
                         prefill=_prefill_name(config))
    return namespace_digest(spec)


def _prefill_name(config: EngineConfig) -> str:
    """'' for the default prefill; 'invariant' for one chunk per forward (the name of the first release, kept so
    its caches stay warm); 'invariant-N' for N chunks per forward, whose K/V round apart from one chunk's."""
    if not config.invariant_prefill:
        return ""
    return "invariant" if config.invariant_piece_chunks == 1 else f"invariant-{config.invariant_piece_chunks}"
