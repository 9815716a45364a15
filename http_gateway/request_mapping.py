"""OpenAI request bodies -> kvboost.v1 requests (pure; raises GatewayError for what cannot be served)."""
from __future__ import annotations

from typing import Any

from http_gateway.errors import invalid_request, unsupported
from http_gateway.schemas import (
    ChatCompletionRequest, ChatMessageIn, CompletionRequest, KVBoostOptions, TokenizeRequest, UnpinRequest, WarmRequest,
    _Body, _Sampling, MIN_TEMPERATURE, ROLES, UNSUPPORTED_NEUTRAL_VALUES,
)
from kvboost.v1 import inference_pb2 as pb

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI samples when no temperature is given
_SEED_MASK = (1 << 64) - 1  # OpenAI seeds are signed 64-bit; ours are unsigned


def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def json_equal(value: Any, other: Any) -> bool:
    """Equality as JSON (and JSON Schema's `const`) sees it: 0 == 0.0, but false is neither 0 nor null."""
    if isinstance(value, bool) or isinstance(other, bool):
        return type(value) is type(other) and value == other
    if isinstance(value, (int, float)) and isinstance(other, (int, float)):
        return value == other
    if isinstance(value, list) and isinstance(other, list):
        return len(value) == len(other) and all(map(json_equal, value, other))
    if isinstance(value, dict) and isinstance(other, dict):
        return value.keys() == other.keys() and all(json_equal(value[key], other[key]) for key in value)
    return type(value) is type(other) and value == other


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
assert set(_ROLES) == set(ROLES), "the schema's roles are the ones mapped"


def refuse_unsupported(body: _Body) -> None:
    """Raises a 400 naming every known-unsupported field given with a value that matters."""
    extra = body.model_extra or {}
    names = [name for name, neutral in UNSUPPORTED_NEUTRAL_VALUES.items()
             if name in extra and not any(json_equal(extra[name], value) for value in neutral)]
    if names:
        raise unsupported(names)


def chat_request(body: ChatCompletionRequest, request_id: str, default_max_tokens: int,
                 cache_salt: str = "") -> pb.GenerateRequest:
    if body.kvboost is not None and body.kvboost.segments is not None:
        raise invalid_request("kvboost.segments applies to /v1/completions; a chat's prompt is its messages",
                              param="kvboost.segments")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_request("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    request = _sampling_request(body, request_id, max_tokens or default_max_tokens, cache_salt)
    request.strict_context = max_tokens is not None  # the default is capped by the context, a client's is not
    request.messages.extend(chat_messages(body.messages))
    if body.logprobs:
        request.logprobs = True
        request.top_logprobs = body.top_logprobs or 0
    return request


def completion_request(body: CompletionRequest, request_id: str, cache_salt: str = "") -> pb.GenerateRequest:
    request = _sampling_request(body, request_id, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, cache_salt)
    request.strict_context = body.max_tokens is not None
    prompt = completion_prompt(body)
    segments = body.kvboost.segments if body.kvboost is not None else None
    if segments is not None:
        if prompt not in ("", "".join(segments)):
            raise invalid_request("with kvboost.segments, prompt must be empty or the segments joined",
                                  param="prompt")
        request.segments.extend(segments)
    elif not prompt:
        raise invalid_request("prompt must not be empty", param="prompt")
    else:
        request.prompt = prompt
    if body.logprobs is not None:
        request.logprobs = True
        request.top_logprobs = body.logprobs
        if body.echo:
            request.prompt_logprobs = body.logprobs
    return request


def completion_prompt(body: CompletionRequest) -> str:
    """The one text prompt of a completions body (a list of one string is accepted)."""
    prompt = body.prompt
    if isinstance(prompt, list):
        if prompt and all(isinstance(item, str) for item in prompt):
            if len(prompt) > 1:
                raise invalid_request(f"prompt is a list of {len(prompt)} prompts; send one prompt per request",
                                      param="prompt", code="unsupported_parameter")
            return prompt[0]
        if prompt:
            raise invalid_request("prompt as token ids is not supported; send text", param="prompt",
                                  code="unsupported_parameter")
        return ""
    return prompt


def chat_messages(messages: list[ChatMessageIn], param: str = "messages") -> list[pb.ChatMessage]:
    converted = []
    for index, message in enumerate(messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise invalid_request(f"{param}[{index}].role {message.role!r} is not supported; use system, developer, "
                                  "user or assistant", param=f"{param}[{index}].role")
        if message.model_extra and not _absent(message.model_extra.get("tool_calls")):
            raise unsupported([f"{param}[{index}].tool_calls"])
        converted.append(pb.ChatMessage(role=role, content=_text_of(message, f"{param}[{index}].content")))
    return converted


def _text_of(message: ChatMessageIn, param: str) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    kinds = sorted({part.type for part in message.content if part.type != "text"})
    if kinds:
        raise invalid_request(f"{param}: only text parts are supported, got {', '.join(kinds)}", param=param,
                              code="unsupported_parameter")
    return "".join(part.text or "" for part in message.content)


def _sampling_request(body: _Sampling, request_id: str, max_tokens: int, cache_salt: str) -> pb.GenerateRequest:
    refuse_unsupported(body)
    if body.min_tokens > max_tokens:
        raise invalid_request(f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})",
                              param="min_tokens")
    request = pb.GenerateRequest(
        max_new_tokens=max_tokens,
        temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        request_id=request_id,
        n=body.n,
        cache_salt=cache_salt,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        stop_token_ids=body.stop_token_ids or [],
    )
    if "" in request.stop:
        raise invalid_request("stop strings must not be empty", param="stop")
    if 0 < request.temperature < MIN_TEMPERATURE:
        raise invalid_request(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}: below it the "
                              "logits divided by it overflow float32", param="temperature")
    if any(token_id < 0 for token_id in request.stop_token_ids):
        raise invalid_request("stop_token_ids must be >= 0", param="stop_token_ids")
    if body.top_p is not None:
        request.top_p = body.top_p
    if body.top_k is not None and body.top_k > 0:  # vLLM: -1 and 0 mean off
        request.top_k = body.top_k
    if body.seed is not None:
        request.seed = body.seed & _SEED_MASK
    _apply_kvboost(request, body.kvboost)
    return request


def _apply_kvboost(request: pb.GenerateRequest, options: KVBoostOptions | None) -> None:
    if options is None:
        return
    if options.mode is not None:
        request.mode = pb.Mode.Value(options.mode.upper())
    if options.recompute_strategy is not None:
        request.recompute_strategy = pb.RecomputeStrategy.Value(options.recompute_strategy.upper())
    for name in ("recompute_ratio", "selective_tokens", "sink_tokens"):
        value = getattr(options, name)
        if value is not None:
            setattr(request, name, value)


def tokenize_request(body: TokenizeRequest) -> pb.TokenizeRequest:
    if bool(body.prompt) == bool(body.messages):  # an empty one is none, as the service counts them
        raise invalid_request("give exactly one of prompt and messages", param="prompt")
    if body.continue_final_message:
        raise invalid_request("continue_final_message is not supported: a chat request always starts a new assistant "
                              "turn, so these ids would not be the ones it prefills (use add_generation_prompt)",
                              param="continue_final_message")
    if body.messages:
        return pb.TokenizeRequest(messages=chat_messages(body.messages),
                                  add_generation_prompt=body.add_generation_prompt)
    return pb.TokenizeRequest(prompt=body.prompt, add_special_tokens=body.add_special_tokens)


def render_request(generate: pb.GenerateRequest) -> pb.TokenizeRequest:
    """The Tokenize call whose ids are the prompt a chat or completion request prefills (vLLM's /render endpoints):
    its messages with the generation prompt, or its text prompt with the tokenizer's special tokens."""
    if generate.segments:
        raise invalid_request("render does not take kvboost.segments: segments are tokenized one by one, and their "
                              "ids are not one prompt's", param="kvboost.segments")
    if generate.messages:
        return pb.TokenizeRequest(messages=generate.messages, add_generation_prompt=True)
    return pb.TokenizeRequest(prompt=generate.prompt, add_special_tokens=True)


def warm_request(body: UnpinRequest, cache_salt: str) -> pb.WarmRequest:
    """A warm-up (WarmRequest) or the Unpin that undoes its pins (UnpinRequest), in the caller's cache scope."""
    if bool(body.text) == bool(body.messages):
        raise invalid_request("give exactly one of text and messages", param="text")
    return pb.WarmRequest(text=body.text or "", messages=chat_messages(body.messages or []),
                          content_addressed=body.content_addressed, pin=isinstance(body, WarmRequest) and body.pin,
                          cache_salt=cache_salt)
