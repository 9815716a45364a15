"""The FastAPI application: endpoints, the OpenAI-shaped error handlers, request ids, metrics, the gRPC client's life."""
from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from http_gateway import errors, openapi
from http_gateway.auth import TRUSTED
from http_gateway.config import GatewayConfig
from http_gateway.disconnect import ClientDisconnected
from http_gateway.endpoints import router
from http_gateway.metrics import GatewayMetrics
from http_gateway.state import Gateway
from http_gateway.upstream import Upstream
from kvboost_common.request_ids import new_request_id

logger = logging.getLogger(__name__)

KNOWN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize",
                         "/v1/kvboost/warm", "/v1/kvboost/unpin", "/health", "/metrics"})
OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key: probes and scrapers
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left (never reaches the client)


def build_app(config: GatewayConfig, upstream_factory: Callable[[GatewayConfig], Upstream] = Upstream) -> FastAPI:
    gateway = Gateway(config, GatewayMetrics(), config.keys())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway.upstream = upstream_factory(config)  # grpc.aio channels belong to the serving loop
        try:
            yield
        finally:
            await gateway.upstream.close()

    app = FastAPI(title="KVBoost OpenAI-compatible gateway", lifespan=lifespan)
    app.state.gateway = gateway
    app.include_router(router)
    _install_error_handlers(app, gateway)
    openapi.install(app, protected=bool(config.api_key_file or config.keys_file), open_paths=OPEN_PATHS,
                    tenants=bool(gateway.keys.tenant_names))
    app.add_middleware(RequestContext, gateway=gateway)
    return app


def _error_response(gateway: Gateway, error: errors.GatewayError, request_id: str) -> JSONResponse:
    gateway.metrics.errors.labels(str(error.status), error.type).inc()
    logger.info("[%s] %s", request_id, error)
    return JSONResponse(error.body(), status_code=error.status, headers={**error.headers, "X-Request-Id": request_id})


def _install_error_handlers(app: FastAPI, gateway: Gateway) -> None:
    def request_id(request: Request) -> str:
        return getattr(request.state, "request_id", "-")

    @app.exception_handler(errors.GatewayError)
    async def gateway_error(request: Request, error: errors.GatewayError) -> Response:
        return _error_response(gateway, error, request_id(request))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(map(str, item['loc']))}: {item['msg']}" for item in error.errors())
        return _error_response(gateway, errors.invalid_request(f"invalid request: {problems}"), request_id(request))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        failure = errors.from_http_status(error.status_code, str(error.detail))
        failure.headers.update(error.headers or {})  # a 405 says which methods the path takes (Allow)
        return _error_response(gateway, failure, request_id(request))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, error: ClientDisconnected) -> Response:
        gateway.metrics.aborted.labels(request.url.path).inc()
        logger.info("[%s] the client went away; the generation was cancelled", request_id(request))
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        return _error_response(gateway, errors.internal(error, request_id(request)), request_id(request))


class RequestContext:
    """Pure ASGI middleware: request id and arrival time on request.state, who the caller is (the API key
    check), the body and concurrency limits, the X-Request-Id header, one log line and the request counter
    per request."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway
        self.in_flight = 0  # requests past the checks and not yet answered (one event loop: no lock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = new_request_id(headers.get(b"x-request-id", b"").decode("latin-1")[:64])
        scope.setdefault("state", {}).update(request_id=request_id, arrival=time.perf_counter(), ttft_seen=False,
                                             caller=TRUSTED)
        path = scope["path"]
        status = {"code": 500}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if not any(name.lower() == b"x-request-id" for name, _ in message.get("headers", [])):
                    message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            refusal = None if path in OPEN_PATHS else self._refusal(scope, headers)
            if refusal is not None:
                await self._refuse(send_with_id, request_id, refusal)
            elif path in OPEN_PATHS:
                await self.app(scope, receive, send_with_id)
            else:
                self.in_flight += 1
                try:
                    await self.app(scope, _bounded(receive, self.gateway.config.max_body_bytes), send_with_id)
                finally:
                    self.in_flight -= 1
        finally:
            endpoint = path if path in KNOWN_PATHS else "other"
            self.gateway.metrics.requests.labels(endpoint, str(status["code"])).inc()
            logger.info("[%s] %s %s -> %d in %.1f ms", request_id, scope["method"], path, status["code"],
                        (time.perf_counter() - scope["state"]["arrival"]) * 1000)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> errors.GatewayError | None:
        """Why the request is answered before it reaches an endpoint (401, 413, 429), or None; sets its caller."""
        caller = self.gateway.keys.caller(headers.get(b"authorization", b""))
        if caller is None:
            return errors.GatewayError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                                       "authentication_error", None, "invalid_api_key")
        scope["state"]["caller"] = caller
        limit = self.gateway.config.max_body_bytes
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > limit:
            return errors.body_too_large(limit)
        if self.in_flight >= self.gateway.config.max_concurrent_requests:
            return errors.too_many_requests(f"{self.in_flight} requests are in flight, the gateway's limit "
                                            "(--max-concurrent-requests); retry later", self.gateway.config.retry_after_s)
        return None

    async def _refuse(self, send: Send, request_id: str, error: errors.GatewayError) -> None:
        self.gateway.metrics.errors.labels(str(error.status), error.type).inc()
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _bounded(receive: Receive, limit: int) -> Receive:
    """receive() that raises 413 once the body grows past `limit` bytes (a chunked body declares no length)."""
    seen = 0

    async def bounded() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise errors.body_too_large(limit)
        return message
    return bounded
