"""Builds request messages from Python values; no I/O."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

from kvboost.v1 import inference_pb2

from client.errors import InvalidArgumentError

# A chat message as a {"role": ..., "content": ...} mapping, a (role, content) pair or the proto.
MessageLike = Union[Mapping[str, str], Sequence[str], inference_pb2.ChatMessage]
# One entry of a batch: a prompt string, keyword arguments of `build_generate_request`, or the proto.
RequestLike = Union[str, Mapping[str, Any], inference_pb2.GenerateRequest]


def parse_enum(enum_type, value: str | int | None, what: str) -> int:
    """The number of an enum value given as a number or a case-insensitive name ('prefix-cache' too)."""
    if value is None:
        return 0
    if isinstance(value, int):
        if value not in enum_type.values():
            raise InvalidArgumentError(f"unknown {what} {value}")
        return value
    name = value.strip().upper().replace("-", "_")
    if name not in enum_type.keys():
        choices = ", ".join(key.lower() for key in enum_type.keys() if not key.endswith("UNSPECIFIED"))
        raise InvalidArgumentError(f"unknown {what} {value!r}; choose one of: {choices}")
    return enum_type.Value(name)


def parse_mode(value: str | int | None) -> int:
    return parse_enum(inference_pb2.Mode, value, "mode")


def parse_recompute_strategy(value: str | int | None) -> int:
    return parse_enum(inference_pb2.RecomputeStrategy, value, "recompute strategy")


def build_messages(messages: Iterable[MessageLike]) -> list[inference_pb2.ChatMessage]:
    built = []
    for message in messages:
        if isinstance(message, inference_pb2.ChatMessage):
            built.append(message)
        elif isinstance(message, Mapping):
            built.append(inference_pb2.ChatMessage(role=message["role"], content=message["content"]))
        else:
            role, content = message
            built.append(inference_pb2.ChatMessage(role=role, content=content))
    return built


def build_generate_request(
    prompt: str | None = None,
    *,
    messages: Iterable[MessageLike] | None = None,
    segments: Sequence[str] | None = None,
    max_new_tokens: int | None = None,
    mode: str | int | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    recompute_strategy: str | int | None = None,
    recompute_ratio: float | None = None,
    selective_tokens: int | None = None,
    request_id: str = "",
) -> inference_pb2.GenerateRequest:
    """A GenerateRequest; exactly one of prompt, messages, segments must be given.

    Raises:
        InvalidArgumentError: when none or several prompt forms are given, or a value is out of range.
    """
    given = [name for name, value in (("prompt", prompt), ("messages", messages), ("segments", segments))
             if value is not None]
    if len(given) != 1:
        raise InvalidArgumentError(f"give exactly one of prompt, messages, segments (got {given or 'none'})")
    if isinstance(segments, str):
        raise InvalidArgumentError("segments must be a list of strings, not one string")
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgumentError(f"temperature must be finite and >= 0, got {temperature}")
    request = inference_pb2.GenerateRequest(
        prompt=prompt or "",
        messages=build_messages(messages or ()),
        segments=list(segments or ()),
        max_new_tokens=max_new_tokens or 0,
        mode=parse_mode(mode),
        temperature=temperature,
        stop=list(stop),
        recompute_strategy=parse_recompute_strategy(recompute_strategy),
        request_id=request_id,
    )
    # Optional fields: set only when given, so the server applies its own defaults otherwise.
    for name, value in (("top_p", top_p), ("top_k", top_k), ("seed", seed),
                        ("recompute_ratio", recompute_ratio), ("selective_tokens", selective_tokens)):
        if value is not None:
            setattr(request, name, value)
    return request


def build_batch_request(requests: Iterable[RequestLike]) -> inference_pb2.GenerateBatchRequest:
    built = []
    for request in requests:
        if isinstance(request, inference_pb2.GenerateRequest):
            built.append(request)
        elif isinstance(request, str):
            built.append(build_generate_request(request))
        else:
            built.append(build_generate_request(**request))
    return inference_pb2.GenerateBatchRequest(requests=built)


def build_warm_request(
    text: str | None = None,
    *,
    messages: Iterable[MessageLike] | None = None,
    content_addressed: bool = False,
    pin: bool = False,
) -> inference_pb2.WarmRequest:
    if (text is None) == (messages is None):
        raise InvalidArgumentError("give exactly one of text, messages")
    return inference_pb2.WarmRequest(
        text=text or "", messages=build_messages(messages or ()), content_addressed=content_addressed, pin=pin
    )


def parse_key(key: str | bytes) -> bytes:
    """A 32-byte digest given as raw bytes or as 64 hex characters."""
    raw = key if isinstance(key, bytes) else _from_hex(key)
    if len(raw) != 32:
        raise InvalidArgumentError(f"a key is 32 bytes (64 hex characters), got {len(raw)} bytes")
    return raw


def _from_hex(text: str) -> bytes:
    try:
        return bytes.fromhex(text.strip())
    except ValueError as error:
        raise InvalidArgumentError(f"not a hex key: {text!r}") from error
