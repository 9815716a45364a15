"""Client exceptions: one class per kind of failure, each carrying the gRPC status code."""
from __future__ import annotations

import grpc


class KVBoostError(Exception):
    """A call to the inference service or the cache daemon failed.

    Attributes:
        code: the gRPC status code, or None when the failure happened in the client.
        details: the server's message (or the client's, when code is None).
    """

    def __init__(self, message: str, code: grpc.StatusCode | None = None, details: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.details = details or message


class InvalidArgumentError(KVBoostError, ValueError):
    """The request was refused as malformed (INVALID_ARGUMENT, OUT_OF_RANGE)."""


class NotFoundError(KVBoostError):
    """The keys or namespace do not exist (NOT_FOUND)."""


class UnavailableError(KVBoostError, ConnectionError):
    """The server cannot be reached or is shutting down (UNAVAILABLE)."""


class DeadlineExceededError(KVBoostError, TimeoutError):
    """The call ran past its timeout (DEADLINE_EXCEEDED)."""


class OverloadedError(KVBoostError):
    """The server's queue is full; retry later (RESOURCE_EXHAUSTED)."""


class AuthenticationError(KVBoostError, PermissionError):
    """The bearer token is missing or wrong (UNAUTHENTICATED, PERMISSION_DENIED)."""


class CancelledError(KVBoostError):
    """The call was cancelled (CANCELLED)."""


class FailedPreconditionError(KVBoostError):
    """The server cannot do this in its present state (FAILED_PRECONDITION)."""


# Details gRPC gives when it could not connect at all (as opposed to a server answering UNAVAILABLE).
_CONNECTION_FAILURES = ("failed to connect", "Connection refused", "DNS resolution failed", "Socket closed",
                        "Connection reset")

_CLASS_BY_CODE: dict[grpc.StatusCode, type[KVBoostError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
}


def from_rpc_error(error: grpc.RpcError, method: str, address: str, timeout: float | None) -> KVBoostError:
    """The KVBoostError subclass for a failed call, with a message naming the call and the server."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else "") or ""
    if code == grpc.StatusCode.UNAVAILABLE and _is_connection_failure(details):
        message = f"cannot reach {address} ({method}): {details}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"{method} on {address} timed out after {timeout} s"
    else:
        message = f"{method} on {address} failed: {code.name}: {details}"
    return _CLASS_BY_CODE.get(code, KVBoostError)(message, code=code, details=details)


def _is_connection_failure(details: str) -> bool:
    """True when gRPC itself could not connect; False when the server answered UNAVAILABLE
    (for instance while its model is still loading)."""
    return not details or any(sign in details for sign in _CONNECTION_FAILURES)
