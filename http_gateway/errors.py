"""The one place that turns failures into OpenAI-shaped errors: gRPC statuses, bad bodies, unknown routes."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from pydantic import ValidationError

logger = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code).
_BY_GRPC_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "server_error", "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
# Words of the service's messages that name a request field, and the OpenAI name of that field.
_PARAM_NAMES = (("max_new_tokens", "max_tokens"), ("prompt has", "messages"), ("temperature", "temperature"),
                ("top_p", "top_p"), ("top_k", "top_k"), ("min_tokens", "min_tokens"), ("stop", "stop"),
                ("segments", "kvboost.segments"), ("message role", "messages"), ("logprobs", "logprobs"))


@dataclass
class GatewayError(Exception):
    """A failure the client is told about as {"error": {message, type, param, code}} with an HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", param, code)


def unsupported(names: list[str]) -> GatewayError:
    return invalid_request(f"unsupported parameter(s): {', '.join(names)}; this server does not implement "
                           f"{'it' if len(names) == 1 else 'them'}, remove {'it' if len(names) == 1 else 'them'} "
                           "from the request", param=names[0], code="unsupported_parameter")


def body_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"the request body is over the gateway's limit of {limit} bytes (--max-body-bytes); "
                             "send a shorter prompt", "invalid_request_error", None, "request_too_large")


def too_many_requests(message: str, retry_after_s: float) -> GatewayError:
    return GatewayError(429, message, "rate_limit_error", None, "rate_limit_exceeded",
                        {"Retry-After": f"{retry_after_s:g}"})


def permission_denied(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(403, message, "permission_error", param, "permission_denied")


def model_not_found(name: str) -> GatewayError:
    return GatewayError(404, f"The model `{name}` does not exist; GET /v1/models lists the served one.",
                        "invalid_request_error", "model", "model_not_found")


def from_rpc_error(error: grpc.RpcError, retry_after_s: float = 1.0) -> GatewayError:
    """The HTTP status and OpenAI error of a failed call to the inference service."""
    status_code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else "") or status_code.name
    status, kind, code = _BY_GRPC_STATUS.get(status_code, (500, "server_error", None))
    param = None
    if status_code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in details:
        # gRPC's own size limit: the request can never fit, so a 429 would have the client retry it forever.
        return GatewayError(413, f"the request is larger than the inference service accepts "
                                 f"(its --max-message-bytes): {details}", "invalid_request_error", None,
                            "request_too_large")
    if status == 400:
        param = next((name for word, name in _PARAM_NAMES if word in details), None)
        if details.startswith(("prompt has", "the context holds")):
            code = "context_length_exceeded"
    if status == 429:
        return too_many_requests(details, retry_after_s)
    if status == 503 and ("failed to connect" in details or "Connection refused" in details):
        details = f"the inference service cannot be reached: {details}"
    return GatewayError(status, details, kind, param, code)


def from_validation_error(error: ValidationError) -> GatewayError:
    """A body that does not parse or does not fit the schema: 400 naming each wrong field."""
    problems = []
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"] if part not in ("body",))
        problems.append(f"{where}: {item['msg']}" if where else item["msg"])
    first = error.errors(include_url=False)[0]["loc"] if error.error_count() else ()
    param = ".".join(str(part) for part in first if part != "body") or None
    return invalid_request("invalid request body: " + "; ".join(problems), param=param)


def from_http_status(status: int, detail: str) -> GatewayError:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(status, "invalid_request_error")
    return GatewayError(status, detail, kind, None, None)


def internal(error: BaseException, request_id: str) -> GatewayError:
    logger.exception("[%s] internal error", request_id, exc_info=error)
    return GatewayError(500, f"internal error in the gateway ({type(error).__name__}); request id {request_id}",
                        "server_error", None, None)
