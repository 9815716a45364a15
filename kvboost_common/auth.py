"""Optional bearer-token authentication of every RPC except health checks (both servers)."""
from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
from contextvars import ContextVar
from pathlib import Path
from typing import Callable, Generic, Mapping, TypeVar

import grpc

from kvboost_common.handlers import Behavior, metadata_value, replace_behavior

logger = logging.getLogger(__name__)

# Orchestrators probe health without credentials; it reveals nothing about the cache or the model.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
DENIAL = "missing or wrong bearer token: send metadata `authorization: Bearer <token>` with the server's token"
_BEARER = "Bearer "
P = TypeVar("P")


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

    def __init__(self, token: str, on_refused: Callable[[], None] | None = None) -> None:
        self._token = token
        self._on_refused = on_refused

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if is_authorized(metadata_value(details, "authorization"), self._token):
            return handler
        if self._on_refused is not None:
            self._on_refused()
        return replace_behavior(handler, lambda _: _denial(details.method))


class TokenTableInterceptor(grpc.aio.ServerInterceptor, Generic[P]):
    """Many tokens, each naming a principal (a tenant): the caller's principal is set in
    `principal_var` while its call runs; a call without a known token is UNAUTHENTICATED."""

    def __init__(self, principals_by_token: Mapping[str, P], principal_var: ContextVar[P | None],
                 on_refused: Callable[[], None] | None = None) -> None:
        # Looked up by the token's SHA-256: a dict probe on a digest tells a timing attacker nothing
        # about the tokens, where comparing the tokens themselves byte by byte would.
        self._by_digest = {_token_digest(token): principal for token, principal in principals_by_token.items()}
        self._principal_var = principal_var
        self._on_refused = on_refused

    def principal_for(self, authorization: str | None) -> P | None:
        if authorization is None or not authorization.startswith(_BEARER):
            return None
        return self._by_digest.get(_token_digest(authorization[len(_BEARER):]))

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        principal = self.principal_for(metadata_value(details, "authorization"))
        if principal is None:
            if self._on_refused is not None:
                self._on_refused()
            return replace_behavior(handler, lambda _: _denial(details.method))
        return replace_behavior(handler, lambda behavior: _as_principal(behavior, self._principal_var, principal))


def _token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _as_principal(behavior: Behavior, principal_var: ContextVar, principal) -> Behavior:
    if inspect.isasyncgenfunction(behavior):
        async def streaming(request, context):
            principal_var.set(principal)
            async for response in behavior(request, context):
                yield response
        return streaming

    async def unary(request, context):
        principal_var.set(principal)
        return await behavior(request, context)
    return unary


def _denial(method: str):
    async def deny(request, context: grpc.aio.ServicerContext) -> None:
        logger.warning("rejected a call to %s without a valid bearer token", method)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIAL)
    return deny  # a coroutine serves streaming methods too: grpc.aio ends the call at the abort
