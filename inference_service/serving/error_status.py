"""The one place that maps the service's domain errors to gRPC status codes."""
from __future__ import annotations

import logging

import grpc

from inference_service import errors
from inference_service.store.protocol import StoreUnavailable
from inference_service.serving.jobs import DeadlineExceeded, JobCancelled, ModelNotLoaded

logger = logging.getLogger(__name__)

# Most specific first: the first class an error is an instance of decides its code.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode, str], ...] = (
    (errors.PromptTooLong, grpc.StatusCode.INVALID_ARGUMENT, "shorten the prompt or start the service with a larger --max-prompt-tokens"),
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (errors.UnsupportedArchitecture, grpc.StatusCode.FAILED_PRECONDITION, "serve a supported model or start with --no-strict"),
    (errors.QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    (errors.RequestCancelled, grpc.StatusCode.CANCELLED, ""),
    (JobCancelled, grpc.StatusCode.CANCELLED, ""),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, ""),
    (errors.EngineStopped, grpc.StatusCode.UNAVAILABLE, "retry against a running service"),
    (errors.EngineFatal, grpc.StatusCode.UNAVAILABLE, "the service restarts; retry"),
    (ModelNotLoaded, grpc.StatusCode.UNAVAILABLE, "retry once the health service reports SERVING"),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE, "check that the cache daemon is running at --cache-addr"),
)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and a message saying what went wrong and what to change."""
    for kind, code, hint in _CODES:
        if isinstance(error, kind):
            message = str(error) or kind.__name__
            return code, f"{message} ({hint})" if hint else message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException, request_id: str = "") -> None:
    """Ends the RPC with the status that `error` maps to (never returns)."""
    code, message = status_of(error)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("[%s] request failed", request_id or "-", exc_info=error)
    else:
        logger.info("[%s] %s: %s", request_id or "-", code.name, message)
    await context.abort(code, message)
