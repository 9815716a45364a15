"""Builds the router's grpc.aio server: the InferenceService API, health, reflection, optional bearer token and TLS."""
from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvboost.v1 import inference_pb2_grpc
from kvboost_common.auth import BearerTokenInterceptor
from kvboost_common.binding import bind
from kvboost_common.undecodable import UndecodableRequestInterceptor
from router.config import RouterConfig
from router.metrics import start_metrics_server
from router.monitor import SERVICE_NAME
from router.request_keys import RequestKeys
from router.routing import Router
from router.servicer import RouterServicer

logger = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING


class RouterServer:
    """A grpc.aio.Server with the bound port; health says SERVING once started (start-up checks come first)."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer, router: Router,
                 config: RouterConfig) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self.router = router
        self.config = config
        self._stop_metrics = None

    async def start(self) -> None:
        await self.server.start()
        if self.config.metrics_port:
            self._stop_metrics = start_metrics_server(self.router, self.config.host, self.config.metrics_port)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _SERVING)

    async def stop(self, grace_s: float | None = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self._stop_metrics is not None:
            self._stop_metrics()


def build_server(config: RouterConfig, router: Router, keys: RequestKeys | None) -> RouterServer:
    """Binds config.listen (port 0 picks a free port, see `.port`); serves once started.

    keys: None unless the policy reads requests' keys (only prefix does).
    """
    token = config.auth_token()
    # The undecodable-request check is innermost: unauthenticated calls are refused first.
    interceptors = [BearerTokenInterceptor(token)] if token else []
    interceptors.append(UndecodableRequestInterceptor())
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes)])
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(RouterServicer(router, keys, config.warm), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = bind(server, config.listen, config.tls_cert or None, config.tls_key or None)
    if not config.listens_on_loopback and token is None:
        logger.warning("listening on %s without --auth-token-file: anyone who can reach it can use the replicas",
                       config.listen)
    return RouterServer(server, port, health_servicer, router, config)
