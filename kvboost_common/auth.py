"""Optional bearer-token authentication of every RPC except health checks (both servers)."""
from __future__ import annotations

import hmac
import logging
from pathlib import Path

import grpc

from kvboost_common.handlers import metadata_value, replace_behavior

logger = logging.getLogger(__name__)

# Orchestrators probe health without credentials; it reveals nothing about the cache or the model.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
DENIAL = "missing or wrong bearer token: send metadata `authorization: Bearer <token>` with the server's token"


def load_token(path: Path | str) -> str:
    """The token in a file, whitespace stripped. Raises ValueError when the file is empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token


def is_authorized(authorization: str | None, token: str) -> bool:
    """True when the metadata value is exactly 'Bearer <token>' (compared in constant time)."""
    expected = f"Bearer {token}".encode()
    return authorization is not None and hmac.compare_digest(str(authorization).encode(), expected)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without 'authorization: Bearer <token>' metadata with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if is_authorized(metadata_value(details, "authorization"), self._token):
            return handler
        return replace_behavior(handler, lambda _: _denial(details.method))


def _denial(method: str):
    async def deny(request, context: grpc.aio.ServicerContext) -> None:
        logger.warning("rejected a call to %s without a valid bearer token", method)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIAL)
    return deny  # a coroutine serves streaming methods too: grpc.aio ends the call at the abort
