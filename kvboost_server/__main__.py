"""`python -m kvboost_server [service flags] [--gateway [gateway flags]]`: the OpenAI-compatible gateway and the
inference service in one process.

The gateway's app reaches the servicer through kvboost_server.in_process (no gRPC hop, no second process); the
service still serves its gRPC contract on its own --listen address. Flags before `--gateway` are the service's
(`python -m inference_service --help`), flags after it the gateway's (`python -m http_gateway --help`; its
--service-addr, --token and --tls do not apply: the gateway calls the servicer directly).
"""
from __future__ import annotations

import sys

from inference_service import mkl_dispatch

GATEWAY_MARK = "--gateway"


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(service flags, gateway flags): the arguments before and after GATEWAY_MARK."""
    if GATEWAY_MARK not in argv:
        return argv, []
    at = argv.index(GATEWAY_MARK)
    return argv[:at], argv[at + 1:]


if __name__ == "__main__":
    try:  # before torch loads (see inference_service/__main__.py)
        mkl_dispatch.apply(mkl_dispatch.asked_in(split_argv(sys.argv[1:])[0]))
    except ValueError:
        pass
    except RuntimeError as error:
        sys.exit(f"kvboost_server: {error}")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import uvicorn  # noqa: E402

from http_gateway.app import build_app  # noqa: E402
from http_gateway.config import GatewayConfig, parse_config as parse_gateway_config  # noqa: E402
from inference_service.model.threads import confine_to_this_thread  # noqa: E402
from kvboost_common.heap import freeze_startup_heap  # noqa: E402
from inference_service.serving.config import ServiceConfig, parse_config as parse_service_config  # noqa: E402
from inference_service.serving.server import build_server  # noqa: E402
from inference_service.serving.kv_events import start_kv_events  # noqa: E402
from inference_service.serving.startup import SHUTDOWN_GRACE_S, WRITE_BACK_FLUSH_S, load_engine, make_store  # noqa: E402
from kvboost_server.in_process import InProcessUpstream  # noqa: E402

logger = logging.getLogger("kvboost_server")


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: it would re-raise SIGTERM after its shutdown, ending the process
    before the engine's write-backs are flushed; serve() below handles the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(service: ServiceConfig, gateway: GatewayConfig) -> int:
    """Loads the model, then serves HTTP (and gRPC) until SIGTERM or SIGINT; returns the exit status."""
    confine_to_this_thread()  # only the engine's step loop runs an OpenMP team (model/threads.py)
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(thread_name_prefix="kvboost-plan", initializer=confine_to_this_thread))
    store = make_store(service)
    server = build_server(service, engine=None, store=store)
    await server.start()
    logger.info("gRPC on %s (port %d); loading %s", service.listen, server.port, service.model)
    try:
        engine = await asyncio.get_running_loop().run_in_executor(None, lambda: load_engine(service, store))
    except Exception as error:
        logger.error("cannot serve %s: %s", service.model, error)
        await server.stop(0)
        getattr(store, "close", lambda: None)()
        return 2
    try:
        kv_events = start_kv_events(service, engine)
    except Exception as error:  # a port taken, an endpoint ZMQ refuses
        logger.error("cannot publish KV events on %s: %s", service.kv_events_endpoint, error)
        await server.stop(0)
        engine.close()
        getattr(store, "close", lambda: None)()
        return 2
    await server.set_engine(engine)
    freeze_startup_heap()
    app = build_app(gateway, upstream_factory=lambda config: InProcessUpstream(server.servicer, server.health,
                                                                               config.timeout_s))
    http = _HttpServer(uvicorn.Config(app, host=gateway.host, port=gateway.port, log_level=gateway.log_level.lower(),
                                         access_log=False, timeout_graceful_shutdown=10,
                                         ssl_certfile=gateway.https_cert or None, ssl_keyfile=gateway.https_key or None))
    logger.info("model %s loaded: HTTP on %s://%s, in process", service.model,
                "https" if gateway.https_cert else "http", gateway.listen)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: setattr(http, "should_exit", True))
    try:
        await http.serve()  # until SIGTERM or SIGINT
    finally:
        logger.info("shutting down")
        await server.stop(SHUTDOWN_GRACE_S)
        engine.flush_writes(timeout=WRITE_BACK_FLUSH_S)  # chunks computed so far still reach the daemon
        engine.close()
        if kv_events is not None:
            kv_events.close()
        getattr(store, "close", lambda: None)()
    return 0


def main(argv: list[str] | None = None) -> None:
    service_argv, gateway_argv = split_argv(sys.argv[1:] if argv is None else argv)
    if "-h" in service_argv or "--help" in service_argv:
        print(__doc__.strip(), "\n", flush=True)
        print("== the service's flags (before --gateway) ==", flush=True)
        parse_service_config(["--help"])
    if "-h" in gateway_argv or "--help" in gateway_argv:
        print("== the gateway's flags (after --gateway) ==", flush=True)
        parse_gateway_config(["--help"])
    service = parse_service_config(service_argv)
    gateway = parse_gateway_config(gateway_argv)
    logging.basicConfig(level=service.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("configuration:\n%s\n%s", service.describe(), gateway.describe())
    dispatch = mkl_dispatch.apply(service.mkl_dispatch)
    logger.info("MKL dispatch: %s", dispatch.describe())
    sys.exit(asyncio.run(serve(service, gateway)))


if __name__ == "__main__":
    main()
