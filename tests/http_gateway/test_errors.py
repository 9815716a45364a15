"""The one mapping from gRPC statuses (and bad bodies) to OpenAI-shaped errors."""
from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from http_gateway.errors import from_rpc_error, from_validation_error
from http_gateway.schemas import ChatCompletionRequest


def rpc_error(code: grpc.StatusCode, details: str = "details") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code, status, kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
])
def test_status_mapping(code, status, kind):
    error = from_rpc_error(rpc_error(code))
    assert (error.status, error.type) == (status, kind)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_rate_limit_carries_retry_after():
    error = from_rpc_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED), retry_after_s=2.5)
    assert error.headers == {"Retry-After": "2.5"} and error.code == "rate_limit_exceeded"


def test_a_long_prompt_is_context_length_exceeded():
    error = from_rpc_error(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt has 5000 tokens; at most 4096 are accepted"))
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")


def test_service_messages_name_the_openai_field():
    error = from_rpc_error(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens 9000 is over the server's limit"))
    assert error.param == "max_tokens"


def test_validation_errors_are_400_naming_the_field():
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate_json(b'{"messages": [{"role": "user", "content": "x"}], "n": 0}')
    error = from_validation_error(raised.value)
    assert (error.status, error.param) == (400, "n") and "n: Input should be greater than or equal to 1" in error.message


def test_unparsable_json_is_400():
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate_json(b"{not json")
    assert from_validation_error(raised.value).status == 400
