"""Requests whose bytes do not parse (corrupt wire format, invalid UTF-8 in a string) get INVALID_ARGUMENT."""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from kvboost_common.handlers import behavior_of

logger = logging.getLogger(__name__)

@dataclass(slots=True, frozen=True)
class Undecodable:
    """Stands in for a request message that failed to parse, so the servicer never sees it."""
    reason: str


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Without it grpc.aio answers a DecodeError with UNKNOWN; register it last (innermost), so that
    interceptors outside it, such as the bearer-token check, still answer first."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or not _is_async(behavior_of(handler)[1]):
            return handler
        return guard_handler(handler, details.method)


def guard_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """The handler with a deserializer that returns Undecodable instead of raising, and a behavior that
    aborts with INVALID_ARGUMENT on it (for streamed requests: at the first undecodable message)."""
    field, behavior = behavior_of(handler)
    return handler._replace(request_deserializer=_lenient(handler.request_deserializer),
                            **{field: _guarded(behavior, handler.request_streaming, method)})


def _is_async(behavior: Callable[..., Any]) -> bool:
    # Synchronous behaviors (none are registered today) run in grpc's thread pool; they are left alone.
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


def describe(error: DecodeError) -> str:
    if "UTF-8" in str(error):
        return f"a string field was not valid UTF-8 (proto3 strings must be UTF-8): {error}"
    return f"the bytes are not a valid protobuf message: {error}"


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(serialized: bytes) -> Any:
        try:
            return deserialize(serialized)
        except DecodeError as error:
            return Undecodable(describe(error))
    return parse


async def _abort(context: grpc.aio.ServicerContext, method: str, request: Undecodable) -> None:
    logger.info("%s -> INVALID_ARGUMENT: request not parsed: %s", method, request.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: request not parsed: {request.reason}")


def _guarded(behavior: Callable[..., Any], request_streaming: bool, method: str) -> Callable[..., Any]:
    async def checked(requests: AsyncIterator[Any], context) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, Undecodable):
                await _abort(context, method, request)
            yield request

    async def request_for(request_or_iterator, context):
        if request_streaming:
            return checked(request_or_iterator, context)
        if isinstance(request_or_iterator, Undecodable):
            await _abort(context, method, request_or_iterator)
        return request_or_iterator

    if inspect.isasyncgenfunction(behavior):
        async def streaming(request_or_iterator, context):
            async for response in behavior(await request_for(request_or_iterator, context), context):
                yield response
        return streaming

    async def unary(request_or_iterator, context):
        return await behavior(await request_for(request_or_iterator, context), context)
    return unary
