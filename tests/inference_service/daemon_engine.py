"""An Engine over a real cache daemon process (its LMDB in a test's folder), for the real-model tests."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from inference_service.engine.engine import Engine, EngineConfig
from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions
from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon


@contextmanager
def engine_over_daemon(model_tokenizer_path, data_dir: Path, config: EngineConfig) -> Iterator[Engine]:
    """model_tokenizer_path: what the smollm2 fixture gives. Stops the engine, its store and the daemon after."""
    model, tokenizer, path = model_tokenizer_path
    daemon = start_daemon(data_dir, pick_free_port())
    store = GrpcChunkStore(GrpcStoreOptions(address=daemon.address))
    engine = Engine(model, tokenizer, config, store, model_id=path)
    try:
        yield engine
    finally:
        engine.close()
        store.close()
        daemon.terminate()
