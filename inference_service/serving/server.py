"""Builds the grpc.aio server: inference servicer, health, reflection, optional bearer token and TLS."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inference_service.engine.engine import Engine
from inference_service.serving.config import ServiceConfig
from inference_service.serving.metrics import start_metrics_server
from inference_service.serving.servicer import InferenceServicer
from kvboost.v1 import inference_pb2, inference_pb2_grpc
from kvboost_common.auth import BearerTokenInterceptor
from kvboost_common.binding import bind
from kvboost_common.undecodable import UndecodableRequestInterceptor

logger = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
# Health entry that mirrors the cache daemon as this service sees it: NOT_SERVING while degraded.
CACHE_HEALTH_NAME = "kvboost.v1.CacheService"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class InferenceServer:
    """A grpc.aio.Server with the parts the process drives: the bound port, the engine slot, health."""

    def __init__(self, server: grpc.aio.Server, port: int, servicer: InferenceServicer, health_servicer: Any, store: Any,
                 config: ServiceConfig | None = None) -> None:
        self.config = config
        self.server = server
        self.port = port
        self.servicer = servicer
        self.health = health_servicer
        self.store = store
        self._watch_task: asyncio.Task[None] | None = None
        self._stop_metrics = None

    async def start(self) -> None:
        await self.server.start()
        if self.servicer.engine is not None:
            await self.set_engine(self.servicer.engine)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _SERVING if self.servicer.engine is not None else _NOT_SERVING)
        self._watch_task = asyncio.create_task(self._watch_store())

    async def set_engine(self, engine: Engine) -> None:
        """The model is loaded: requests are served, metrics (when asked for) read it, health turns SERVING."""
        watch_device(engine, self.health, asyncio.get_running_loop())
        self.servicer.engine = engine
        if self.config is not None and self.config.metrics_port and self._stop_metrics is None:
            self._stop_metrics = start_metrics_server(engine.stats, self.config.host, self.config.metrics_port)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _SERVING)

    async def stop(self, grace_s: float | None = 5.0) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)  # the engine is its owner's to stop (__main__ does, after the server)
        if self._stop_metrics is not None:
            self._stop_metrics()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    async def _watch_store(self, interval_s: float = 0.5) -> None:
        reported = None
        while True:
            degraded = bool(getattr(self.store, "degraded", False))
            if degraded != reported:
                await self.health.set(CACHE_HEALTH_NAME, _NOT_SERVING if degraded else _SERVING)
                reported = degraded
            await asyncio.sleep(interval_s)


def build_server(config: ServiceConfig, engine: Engine | None = None, store: Any = None) -> InferenceServer:
    """Binds config.listen (port 0 picks a free port, see `.port`); serves once started.

    engine may be None while the model loads (health NOT_SERVING, calls UNAVAILABLE); `store` is the
    engine's ChunkStore (default: engine.store), whose degraded flag health mirrors.
    """
    store = store if store is not None else getattr(engine, "store", None)
    token = config.auth_token()
    # The undecodable-request check is innermost: unauthenticated calls are refused first.
    interceptors = [BearerTokenInterceptor(token)] if token else []
    interceptors.append(UndecodableRequestInterceptor())
    options = [("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.max_send_message_length", config.max_message_bytes),
               ("grpc.so_reuseport", 0)]  # a second service on the same port must fail, not share its calls
    if config.max_concurrent_streams:
        options.append(("grpc.max_concurrent_streams", config.max_concurrent_streams))
    server = grpc.aio.server(interceptors=interceptors, options=options)
    servicer = InferenceServicer(config.cache_addr, engine)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = bind(server, config.listen, config.tls_cert if config.tls else None, config.tls_key)
    if not config.listens_on_loopback and token is None:
        logger.warning("listening on %s without --auth-token-file: anyone who can reach it can use the model", config.listen)
    return InferenceServer(server, port, servicer, health_servicer, store, config)


def watch_device(engine: Engine, health_servicer: Any, loop: asyncio.AbstractEventLoop) -> None:
    """A dead device (a poisoned CUDA context) turns health NOT_SERVING and ends the process, so its supervisor
    (compose, systemd, Kubernetes) starts a fresh one; nothing on the device could be trusted any more."""

    def on_fatal(error: BaseException) -> None:
        logger.critical("the device failed, exiting for a restart: %s", error)
        try:
            done = asyncio.run_coroutine_threadsafe(_not_serving(health_servicer), loop)
            done.result(timeout=2.0)
        finally:
            os._exit(70)  # EX_SOFTWARE

    engine.core.on_fatal = on_fatal


async def _not_serving(health_servicer: Any) -> None:
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, _NOT_SERVING)
