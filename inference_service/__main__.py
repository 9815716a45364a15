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
from typing import Any, Callable, Sequence

from inference_service.serving.config import ServiceConfig, parse_config
from inference_service.errors import UnsupportedArchitecture
from kvboost_common.catalogue import CatalogueError
from kvboost_common.heap import freeze_startup_heap
from inference_service.serving.kv_events import start_kv_events
from inference_service.serving.server import build_server
from inference_service.serving.startup import SHUTDOWN_GRACE_S, WRITE_BACK_FLUSH_S, load_engine, make_store
from inference_service.model.threads import confine_to_this_thread

__all__ = ["SHUTDOWN_GRACE_S", "WRITE_BACK_FLUSH_S", "load_engine", "main", "make_store", "serve"]

logger = logging.getLogger("inference_service")


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
        freeze_startup_heap()
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
