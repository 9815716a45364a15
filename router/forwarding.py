"""Calls forwarded to a replica as the caller made them: same request, same metadata, the caller's deadline;
one retry elsewhere when the first replica fails before answering anything."""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Sequence

import grpc

from router.replicas import Replica

logger = logging.getLogger(__name__)

# Failures that say nothing about the request itself: another replica may well serve it.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# Metadata gRPC itself sets per hop; everything else the caller sent (its bearer token, request ids, any
# tenant header) is forwarded as it came.
_HOP_KEYS = frozenset({"user-agent", "content-type", "te", "host", "accept-encoding"})
MAX_ATTEMPTS = 2


class UpstreamError(Exception):
    """A replica's failure as the caller will see it: the replica's own status, or UNAVAILABLE naming the
    replica when it went away."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def forwarded_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, Any], ...]:
    """The caller's metadata minus what each gRPC hop sets itself."""
    return tuple((key, value) for key, value in context.invocation_metadata() or ()
                 if not key.startswith((":", "grpc-")) and key not in _HOP_KEYS)


def _note_failure(replica: Replica, error: grpc.aio.AioRpcError) -> None:
    replica.num_failed += 1
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        replica.healthy = False  # skipped until the monitor finds it serving again
        logger.warning("%s is unavailable (%s): skipped until it serves again", replica.name, error.details())


def _passed_on(replica: Replica, error: grpc.aio.AioRpcError, num_events: int = 0) -> UpstreamError:
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        where = f" after {num_events} events" if num_events else ""
        return UpstreamError(grpc.StatusCode.UNAVAILABLE, f"{replica.name} failed{where}: {error.details()}")
    return UpstreamError(error.code(), error.details() or "")


async def unary(replicas: Sequence[Replica], method: str, request: Any,
                context: grpc.aio.ServicerContext) -> Any:
    """The first replica's reply; the second's when the first fails with a RETRYABLE status.

    Raises:
        UpstreamError: the last replica tried failed.
    """
    metadata = forwarded_metadata(context)
    attempts = list(replicas[:MAX_ATTEMPTS])
    for attempt, replica in enumerate(attempts, 1):
        try:
            with replica.routed():
                return await getattr(replica.stub, method)(request, metadata=metadata,
                                                           timeout=context.time_remaining())
        except grpc.aio.AioRpcError as error:
            if error.code() in RETRYABLE:
                _note_failure(replica, error)
            if error.code() not in RETRYABLE or attempt == len(attempts):
                raise _passed_on(replica, error) from None
            logger.info("%s on %s: %s; retrying on %s", method, replica.name, error.code().name,
                        attempts[attempt].name)
    raise AssertionError("unreachable: the last attempt returns or raises")


async def generate(replicas: Sequence[Replica], request: Any,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """The first replica's Generate events as they come; the second replica's when the first fails with a
    RETRYABLE status before its first event. A replica that fails later fails only this stream.

    Raises:
        UpstreamError: the stream failed (UNAVAILABLE naming the replica when it went away mid-stream).
    """
    metadata = forwarded_metadata(context)
    attempts = list(replicas[:MAX_ATTEMPTS])
    for attempt, replica in enumerate(attempts, 1):
        num_events = 0
        with replica.routed():
            call = replica.stub.Generate(request, metadata=metadata, timeout=context.time_remaining())
            try:
                async for event in call:
                    num_events += 1
                    yield event
                return
            except grpc.aio.AioRpcError as error:
                if error.code() in RETRYABLE:
                    _note_failure(replica, error)
                if num_events or error.code() not in RETRYABLE or attempt == len(attempts):
                    raise _passed_on(replica, error, num_events) from None
                logger.info("Generate on %s: %s before its first event; retrying on %s", replica.name,
                            error.code().name, attempts[attempt].name)
            finally:
                call.cancel()  # the caller went away or the stream ended: the replica stops generating
