"""Domain errors of the inference service; the servicer maps each to one gRPC status code."""
from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequest(EngineError):
    """The request is malformed: empty prompt, out-of-range parameter, unknown mode (INVALID_ARGUMENT)."""


class PromptTooLong(EngineError):
    """The prompt has more tokens than the server accepts (INVALID_ARGUMENT, with a hint)."""

    def __init__(self, num_tokens: int, max_tokens: int) -> None:
        super().__init__(f"prompt has {num_tokens} tokens; at most {max_tokens} are accepted")
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class UnsupportedArchitecture(EngineError):
    """The model's architecture cannot reuse K/V chunks correctly (FAILED_PRECONDITION at start-up)."""


class QueueFull(EngineError):
    """Every place in the engine's queue is taken (RESOURCE_EXHAUSTED: retry later)."""


class EngineStopped(EngineError):
    """The engine is shutting down and takes no more requests (UNAVAILABLE)."""


class EngineFatal(EngineError):
    """The device is unusable (a failed CUDA context): the process must restart (UNAVAILABLE)."""


class RequestCancelled(EngineError):
    """The caller cancelled the request, or its deadline passed, before it produced anything (CANCELLED)."""


def is_device_fatal(error: BaseException) -> bool:
    """A CUDA error poisons the context: nothing on the device can be trusted until the process restarts."""
    text = str(error)
    return isinstance(error, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)
