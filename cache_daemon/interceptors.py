"""Per-RPC wrapping: a request id on every log line and domain errors turned into status codes."""
from __future__ import annotations

import inspect
import logging

import grpc

from cache_daemon.errors import CacheError, status_code_for
from cache_daemon.logs import request_id
from kvboost_common.handlers import Behavior, metadata_value, replace_behavior
from kvboost_common.request_ids import new_request_id

logger = logging.getLogger(__name__)

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
