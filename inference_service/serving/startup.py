"""What a serving process builds from its configuration: the daemon client and the engine (the service's
`__main__` and kvboost_server both start from here)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from inference_service.serving.config import ServiceConfig
from inference_service.store.colocated import ColocatedStore
from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions
from inference_service.store.protocol import ChunkStore, NullStore

logger = logging.getLogger("inference_service")

SHUTDOWN_GRACE_S = 5.0
WRITE_BACK_FLUSH_S = 10.0


def make_store(config: ServiceConfig) -> ChunkStore:
    """The daemon client, or a store that holds nothing when no daemon address is configured."""
    if not config.cache_addr:
        logger.warning("no --cache-addr: every request runs without the cache")
        return NullStore()
    roots = Path(config.cache_tls_ca).read_bytes() if config.cache_tls_ca else None
    remote = GrpcChunkStore(GrpcStoreOptions(
        address=config.cache_addr,
        auth_token=config.cache_auth_token(),
        tls=config.cache_tls or roots is not None,
        tls_root_certificates=roots,
        rpc_timeout_s=config.cache_timeout_s,
        fetch_timeout_s=config.cache_stream_timeout_s,
        store_timeout_s=config.cache_stream_timeout_s,
        reconnect_interval_s=config.cache_timeout_s,
    ))
    return remote if config.cache_local_read == "off" else ColocatedStore(remote, config.cache_local_read)


def load_engine(config: ServiceConfig, store: ChunkStore) -> Any:
    """Checks the architecture from the config, then loads the weights (slow: runs off the event loop)."""
    from inference_service.engine.engine import Engine  # torch and transformers load here
    from inference_service.model.loading import load_model, set_threads

    set_threads(config.threads)
    loaded = load_model(config.model, device=_auto(config.device), dtype=_auto(config.dtype), strict=config.strict)
    if isinstance(store, (GrpcChunkStore, ColocatedStore)) and store.check():
        logger.info("cache daemon at %s answers", store.address)
    return Engine(loaded.model, loaded.tokenizer, config.engine, store, model_id=loaded.model_id,
                  weights_id=loaded.weights_id)


def _auto(value: str) -> str | None:
    return None if value == "auto" else value
