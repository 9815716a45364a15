"""Domain errors map to one gRPC status each, with a message that says what to change."""
from __future__ import annotations

import grpc
import pytest

from inference_service import errors
from inference_service.store.protocol import StoreUnavailable
from inference_service.serving.error_status import status_of
from inference_service.errors import EngineStopped, QueueFull
from inference_service.serving.jobs import DeadlineExceeded, JobCancelled, ModelNotLoaded


@pytest.mark.parametrize("error, code, hint", [
    (errors.InvalidRequest("top_p must be in (0, 1], got 2"), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in"),
    (errors.PromptTooLong(5000, 4096), grpc.StatusCode.INVALID_ARGUMENT, "--max-prompt-tokens"),
    (errors.UnsupportedArchitecture("GPT2 is not supported"), grpc.StatusCode.FAILED_PRECONDITION, "--no-strict"),
    (QueueFull("64 requests are already waiting"), grpc.StatusCode.RESOURCE_EXHAUSTED, "already waiting"),
    (JobCancelled("cancelled while queued"), grpc.StatusCode.CANCELLED, "cancelled"),
    (DeadlineExceeded("allow it more time"), grpc.StatusCode.DEADLINE_EXCEEDED, "more time"),
    (EngineStopped("shutting down"), grpc.StatusCode.UNAVAILABLE, "running service"),
    (ModelNotLoaded("still loading"), grpc.StatusCode.UNAVAILABLE, "SERVING"),
    (StoreUnavailable("Lookup failed"), grpc.StatusCode.UNAVAILABLE, "--cache-addr"),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL, "RuntimeError: boom"),
])
def test_each_error_has_one_code_and_a_hint(error, code, hint) -> None:
    mapped_code, message = status_of(error)
    assert mapped_code == code
    assert hint in message


def test_prompt_too_long_wins_over_its_base_class() -> None:
    # PromptTooLong is an EngineError like InvalidRequest: the more specific entry decides.
    assert "shorten the prompt" in status_of(errors.PromptTooLong(10, 5))[1]
