"""Per-RPC wrapping: a request id on every log line and domain errors turned into status codes."""
from __future__ import annotations

import inspect
import logging

import grpc

from cache_daemon.errors import CacheError, status_code_for
from cache_daemon.logs import request_id
from cache_daemon.metrics import CallsInFlight
from kvboost_common.handlers import Behavior, metadata_value, replace_behavior
from kvboost_common.request_ids import new_request_id

logger = logging.getLogger(__name__)

class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """Sets the request id (the caller's x-request-id, else a fresh one), maps CacheError and counts the calls
    in flight (by method, while their handler runs)."""

    def __init__(self, in_flight: CallsInFlight | None = None) -> None:
        self._in_flight = in_flight or CallsInFlight()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        rpc_id = metadata_value(details, "x-request-id") or new_request_id()
        return replace_behavior(handler, lambda behavior: _in_context(behavior, rpc_id, details.method,
                                                                      self._in_flight))


def _in_context(behavior: Behavior, rpc_id: str, method: str, in_flight: CallsInFlight) -> Behavior:
    name = method.rsplit("/", 1)[-1]
    if inspect.isasyncgenfunction(behavior):
        async def streaming(request, context):
            request_id.set(rpc_id)
            in_flight.enter(name)
            try:
                async for response in behavior(request, context):
                    yield response
            except CacheError as error:
                await _abort(context, error, method)
            finally:
                in_flight.leave(name)
        return streaming

    async def unary(request, context):
        request_id.set(rpc_id)
        in_flight.enter(name)
        try:
            return await behavior(request, context)
        except CacheError as error:
            await _abort(context, error, method)
        finally:
            in_flight.leave(name)
    return unary


async def _abort(context: grpc.aio.ServicerContext, error: CacheError, method: str) -> None:
    code = status_code_for(error)
    logger.info("%s -> %s: %s", method, code.name, error)
    await context.abort(code, str(error))
