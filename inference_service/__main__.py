"""`python -m inference_service`: serve generation with chunk K/V reuse through the cache daemon."""
from __future__ import annotations

import sys

from inference_service import mkl_dispatch

if __name__ == "__main__":
    # First, before anything below imports torch: MKL picks its kernels once, when torch loads it.
    try:
        mkl_dispatch.apply(mkl_dispatch.asked_in(sys.argv[1:]))
    except ValueError:
        pass  # a value that is not a choice: the full parser below says so
    except RuntimeError as error:  # --mkl-dispatch features asked and impossible here
        sys.exit(f"inference_service: {error}")

import asyncio
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from inference_service.store.colocated import ColocatedStore
from inference_service.store.grpc_store import GrpcStoreOptions, GrpcChunkStore
from inference_service.store.protocol import ChunkStore, NullStore
from inference_service.serving.config import ServiceConfig, parse_config
from inference_service.errors import UnsupportedArchitecture
from kvboost_common import catalogue
from kvboost_common.catalogue import CatalogueError
from inference_service.serving.kv_events import start_kv_events
from inference_service.serving.server import build_server
from inference_service.model.threads import confine_to_this_thread

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
    from inference_service.engine.engine import Engine, EngineConfig  # torch and transformers load here
    from inference_service.model.loading import load_model, set_threads

    set_threads(config.threads)
    loaded = load_model(config.model, device=_auto(config.device), dtype=_auto(config.dtype), strict=config.strict)
    engine_config = EngineConfig(
        chunk_size=config.chunk_size,
        kv_cache_bits=config.kv_cache_bits,
        tenant_salt=config.tenant_salt,
        max_new_tokens_limit=config.max_new_tokens,
        max_prompt_tokens=config.max_prompt_tokens or None,
        default_mode=config.default_mode,
        default_recompute_strategy=config.recompute_strategy,
        recompute_ratio=config.recompute_ratio,
        selective_tokens=config.selective_tokens,
        sink_tokens=config.sink_tokens,
        overlap_tokens=config.overlap_tokens,
        guard_threshold=_guard_threshold(config.guard_threshold, loaded.weights_id),
        kv_group_size=config.kv_group_size,
        kv_keys_before_rope=config.kv_keys_before_rope,
        max_running_requests=config.max_running_requests,
        kv_cache_bytes=config.kv_cache_bytes,
        max_store_stream_bytes=config.cache_max_stream_bytes,
        l0_bytes=config.l0_bytes,
        host_tier_bytes=config.host_tier_bytes,
        recompute_when_faster={"auto": None, "on": True, "off": False}[config.recompute_when_faster],
        tokenizer_cache_bytes=config.tokenizer_cache_bytes,
        invariant_prefill=config.invariant_prefill,
        invariant_piece_chunks=config.invariant_piece_chunks,
        invariant_decode={"auto": None, "on": True, "off": False}[config.invariant_decode],
        max_prefill_tokens=config.max_prefill_tokens,
        max_queue=config.max_queue,
        max_answer_tokens_stored=config.max_answer_tokens_stored,
        decode_step=config.decode_step,
    )
    if isinstance(store, (GrpcChunkStore, ColocatedStore)) and store.check():
        logger.info("cache daemon at %s answers", store.address)
    return Engine(loaded.model, loaded.tokenizer, engine_config, store, model_id=loaded.model_id,
                  weights_id=loaded.weights_id)


def _guard_threshold(given: float | None, weights_id: str) -> float:
    """--fidelity-guard as given, else the threshold tuned for these weights (the catalogue's), else the default."""
    if given is not None:
        logger.info("fidelity guard %g (--fidelity-guard)", given)
        return given
    threshold, source = catalogue.guard_threshold_for(weights_id)
    logger.info("fidelity guard %g (%s; --fidelity-guard sets another, 0 turns it off)", threshold, source)
    return threshold


def _auto(value: str) -> str | None:
    return None if value == "auto" else value


async def serve(config: ServiceConfig) -> int:
    """Serves until SIGTERM or SIGINT; returns the exit status."""
    # Only the engine's step loop runs torch ops on an OpenMP team (model/threads.py says why): this event loop's
    # thread and its worker threads (prompt planning) run theirs on themselves.
    confine_to_this_thread()
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(thread_name_prefix="kvboost-plan", initializer=confine_to_this_thread))
    store = make_store(config)
    server = build_server(config, engine=None, store=store)
    await server.start()
    logger.info("listening on %s (port %d); health NOT_SERVING until the model is loaded", config.listen, server.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loading = _in_daemon_thread(lambda: load_engine(config, store))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    engine, status = None, 0
    if loading.done():
        try:
            engine = loading.result()
        except (UnsupportedArchitecture, CatalogueError, OSError, ValueError) as error:
            logger.error("cannot serve %s: %s", config.model, error)
            status = 2
        except Exception:
            logger.exception("loading %s failed", config.model)
            status = 1
    kv_events = None
    if engine is not None:
        try:
            kv_events = start_kv_events(config, engine)
        except Exception as error:  # a port taken, an endpoint ZMQ refuses: say which, and do not serve
            logger.error("cannot publish KV events on %s: %s", config.kv_events_endpoint, error)
            engine.close()
            engine, status = None, 2
    if engine is not None:
        await server.set_engine(engine)
        logger.info("model %s loaded: SERVING", config.model)
        await stopping
    logger.info("shutting down")
    stopping.cancel()
    await server.stop(SHUTDOWN_GRACE_S)
    if engine is not None:
        engine.flush_writes(timeout=WRITE_BACK_FLUSH_S)  # chunks computed so far still reach the daemon
        engine.close()
    if kv_events is not None:
        kv_events.close()
    getattr(store, "close", lambda: None)()
    return status


def _in_daemon_thread(work: Callable[[], Any]) -> asyncio.Future[Any]:
    """Runs `work` on a daemon thread (a signal during a slow load need not wait for it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            value, error = work(), None
        except BaseException as failure:  # handed to the event loop, which reports it
            value, error = None, failure
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop already closed (shut down during the load)
            pass

    threading.Thread(target=run, name="model-load", daemon=True).start()
    return future


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("configuration:\n%s", config.describe())
    dispatch = mkl_dispatch.apply(config.mkl_dispatch)
    if dispatch.asked != config.mkl_dispatch:
        logger.warning("--mkl-dispatch %s asked, but this process set %s first", config.mkl_dispatch, dispatch.asked)
    logger.info("MKL dispatch: %s", dispatch.describe())
    sys.exit(asyncio.run(serve(config)))


if __name__ == "__main__":
    main()
