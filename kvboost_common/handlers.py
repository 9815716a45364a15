"""Rewrapping grpc.aio method handlers: find or replace a handler's one behavior, read call metadata."""
from __future__ import annotations

from typing import Any, Callable

import grpc

Behavior = Callable[..., Any]
_BEHAVIOR_FIELDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def behavior_of(handler: grpc.RpcMethodHandler) -> tuple[str, Behavior]:
    """The one behavior a handler has, with the name of its field."""
    for field in _BEHAVIOR_FIELDS:
        behavior = getattr(handler, field)
        if behavior is not None:
            return field, behavior
    raise ValueError(f"handler {handler!r} has no behavior")


def replace_behavior(handler: grpc.RpcMethodHandler, make: Callable[[Behavior], Behavior],
                     **replaced: Any) -> grpc.RpcMethodHandler:
    """The handler with its behavior replaced by make(behavior) (and any other fields in `replaced`)."""
    field, behavior = behavior_of(handler)
    return handler._replace(**{field: make(behavior)}, **replaced)


def metadata_value(details: grpc.HandlerCallDetails, name: str) -> str | None:
    """The first value of metadata key `name` sent with the call, or None."""
    for key, value in details.invocation_metadata or ():
        if key == name:
            return value
    return None
