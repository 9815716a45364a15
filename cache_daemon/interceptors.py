"""Per-RPC wrapping: a request id on every log line and domain errors turned into status codes."""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import grpc

from cache_daemon.errors import CacheError, status_code_for
from cache_daemon.logs import new_request_id, request_id

logger = logging.getLogger(__name__)

Behavior = Callable[..., Any]
_BEHAVIOR_FIELDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def replace_behavior(handler: grpc.RpcMethodHandler, make: Callable[[Behavior], Behavior]) -> grpc.RpcMethodHandler:
    """The handler with its one behavior function replaced by make(behavior)."""
    for field in _BEHAVIOR_FIELDS:
        behavior = getattr(handler, field)
        if behavior is not None:
            return handler._replace(**{field: make(behavior)})
    raise ValueError(f"handler {handler!r} has no behavior")


def metadata_value(details: grpc.HandlerCallDetails, name: str) -> str | None:
    for key, value in details.invocation_metadata or ():
        if key == name:
            return value
    return None


class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """Sets the request id (the caller's x-request-id, else a fresh one) and maps CacheError."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        rpc_id = metadata_value(details, "x-request-id") or new_request_id()
        return replace_behavior(handler, lambda behavior: _in_context(behavior, rpc_id, details.method))


def _in_context(behavior: Behavior, rpc_id: str, method: str) -> Behavior:
    if inspect.isasyncgenfunction(behavior):
        async def streaming(request, context):
            request_id.set(rpc_id)
            try:
                async for response in behavior(request, context):
                    yield response
            except CacheError as error:
                await _abort(context, error, method)
        return streaming

    async def unary(request, context):
        request_id.set(rpc_id)
        try:
            return await behavior(request, context)
        except CacheError as error:
            await _abort(context, error, method)
    return unary


async def _abort(context: grpc.aio.ServicerContext, error: CacheError, method: str) -> None:
    code = status_code_for(error)
    logger.info("%s -> %s: %s", method, code.name, error)
    await context.abort(code, str(error))
