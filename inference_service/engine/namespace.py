"""The namespace an engine's chunks live under: everything that makes two engines' K/V bytes incompatible."""
from __future__ import annotations

from inference_service.kv import codec
from inference_service.request.types import EngineConfig
from kvboost_keys.namespace import (Namespace, NamespaceSpec, canonical_config_json, dtype_name, namespace_digest,
                                    salted_namespace, tokenizer_identity)

# Salts the namespace of an engine with invariant prefill (EngineConfig.invariant_prefill): its K/V round apart
# from the default prefill's, so neither reads the other's chunks.
PREFILL_SALT = "prefill:chunk-aligned-padded"


def engine_namespace(model, tokenizer, config: EngineConfig, weights_id: str) -> Namespace:
    spec = NamespaceSpec(weights_id=weights_id, config_json=canonical_config_json(model.config),
                         dtype=dtype_name(model.dtype), tokenizer_id=tokenizer_identity(tokenizer),
                         chunk_size=config.chunk_size, kv_cache_bits=config.kv_cache_bits,
                         format_version=codec.BLOB_FORMAT_VERSION, tenant_salt=config.tenant_salt)
    return salted_namespace(namespace_digest(spec), PREFILL_SALT if config.invariant_prefill else "")
