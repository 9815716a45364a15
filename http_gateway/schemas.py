"""Request bodies as pydantic models: OpenAI's fields, vLLM's extras, and KVBoost's own under `kvboost`.

Unknown fields are kept (extra="allow") so request_mapping.py can refuse the known but unsupported ones by
name; everything else unknown is ignored, as OpenAI does. Types are strict, as OpenAI's API is: `"4"` is not a
number and `1` is not `true`. Where request_mapping.py checks a value itself (to say what to fix in its own
words), the field's JSON schema (WithJsonSchema) states what that check accepts, so the OpenAPI document
(http_gateway/openapi.py) describes exactly the bodies the gateway serves.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

MAX_CHOICES = 16  # the service's limit on n
MAX_TOP_LOGPROBS = 20
UINT32_MAX = 2**32 - 1  # the proto's counts and token ids
INT32_MAX = 2**31 - 1  # the service's limit on max_tokens, top_k and stop token ids (below 2**31)
# Below 1e-6 a temperature is no distribution a float32 sampler can draw from reliably (logits / T overflow):
# send 0 for greedy decoding. The proto carries float32, whose nearest value to 1e-6 is below it and refused by
# the service, so the least accepted is the next float32 up.
MIN_TEMPERATURE = 1.0000001111620804e-06
MAX_TEMPERATURE = 100.0
# The proto's top_p and recompute_ratio are float32: a positive double below this would reach the service as 0.
FLOAT32_MIN_POSITIVE = 1.401298464324817e-45
MAX_STOP_STRINGS = 64  # stop strings per request, each at most MAX_STOP_LENGTH characters
MAX_STOP_LENGTH = 1024
ROLES = ("system", "developer", "user", "assistant")  # developer is sent as system

_ABSENT = (None, [], {}, "")
# Fields OpenAI or vLLM define that this server does not implement, with the JSON values that change nothing
# (SDKs and frameworks often send the neutral value; only a value that would change the output is refused).
UNSUPPORTED_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "tools": _ABSENT,
    "tool_choice": (None, "none"),
    "functions": _ABSENT,
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logit_bias": _ABSENT,
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_p": (None, 0),
    "audio": _ABSENT,
    "modalities": (None, ["text"]),
    "prediction": _ABSENT,
    "web_search_options": _ABSENT,
    "best_of": (None, 1),
    "suffix": _ABSENT,
    "use_beam_search": (None, False),
    "guided_json": _ABSENT,
    "guided_regex": _ABSENT,
    "guided_choice": _ABSENT,
    "guided_grammar": _ABSENT,
    "structured_outputs": _ABSENT,
    # A chat always gets a new assistant turn (the generation prompt); continuing the last message is not served.
    "continue_final_message": (None, False),
}


def neutral_schema(values: tuple[Any, ...]) -> dict:
    """JSON Schema's `const` compares as JSON does (0 == 0.0, false != 0), as request_mapping.is_neutral does."""
    return {"anyOf": [{"const": value} for value in values], "description": "not implemented: only this "
            "neutral value is accepted; any other is 400 unsupported_parameter"}


def _schema_extra(properties: dict | None = None, unsupported: bool = False, **keywords):
    """A json_schema_extra that adds `properties` (and, for chat and completions, the unsupported fields with
    their neutral values) and body-level keywords (anyOf, oneOf) for the rules that span fields."""
    def extend(schema: dict) -> None:
        schema.setdefault("properties", {}).update(properties or {})
        if unsupported:
            schema["properties"].update({name: neutral_schema(values)
                                         for name, values in UNSUPPORTED_NEUTRAL_VALUES.items()})
        schema.update(keywords)
    return extend


def _integral(value: Any) -> Any:
    """JSON has one number type: 2.0 is the integer 2 (as JSON Schema's `integer` says); 2.5, "2" and true are not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Integer(minimum: int, maximum: int):  # noqa: N802 (a type)
    """An integer in [minimum, maximum]; 2.0 counts as 2 (the bounds come first so the JSON schema shows them)."""
    return Annotated[int, Field(ge=minimum, le=maximum), BeforeValidator(_integral)]


Count = Integer(0, UINT32_MAX)
TokenId = Integer(0, UINT32_MAX)
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}
_STOP_SCHEMA = {"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS},
                          {"type": "null"}]}
_TEMPERATURE_SCHEMA = {"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_TEMPERATURE,
                                                "maximum": MAX_TEMPERATURE}, {"type": "null"}],
                       "description": "0 is greedy; otherwise at least 1e-6 as float32 (below, logits / T overflow float32)"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class KVBoostOptions(BaseModel):
    """KVBoost's own options, sent as {"kvboost": {...}} (the openai SDK's extra_body)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # our own names: a typo is an error, not silence

    mode: Literal["baseline", "prefix_cache", "chunk_kv_reuse"] | None = None
    # The service refuses segments that are all empty.
    segments: Annotated[list[str] | None, Field(min_length=1), WithJsonSchema({"anyOf": [
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "contains": {"type": "string", "minLength": 1}},
        {"type": "null"}]})] = None
    recompute_strategy: Literal["none", "selective", "cacheblend"] | None = None
    recompute_ratio: float | None = Field(default=None, ge=FLOAT32_MIN_POSITIVE, le=1)
    selective_tokens: Count | None = None
    sink_tokens: Count | None = None


class ChatKVBoostOptions(KVBoostOptions):
    """A chat's `kvboost`: its prompt is its messages, so `segments` (completions only) must stay null."""

    segments: Annotated[list[str] | None, WithJsonSchema(
        {"type": "null", "description": "completions only: a chat's prompt is its messages"})] = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Annotated[str, WithJsonSchema({"const": "text", "description": "only text parts are supported"})]
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True,
                              json_schema_extra=_schema_extra({"tool_calls": neutral_schema(_ABSENT)}))

    role: Annotated[str, WithJsonSchema({"enum": list(ROLES)})]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class _Sampling(_Body):
    """Fields chat and completions share."""

    model: str | None = None
    max_tokens: Integer(1, INT32_MAX) | None = None
    temperature: Annotated[float | None, Field(ge=0, le=MAX_TEMPERATURE), WithJsonSchema(_TEMPERATURE_SCHEMA)] = None
    top_p: float | None = Field(default=None, ge=FLOAT32_MIN_POSITIVE, le=1)
    n: Integer(1, MAX_CHOICES) = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[Union[Annotated[str, Field(max_length=MAX_STOP_LENGTH)],
                          Annotated[list[Annotated[str, Field(max_length=MAX_STOP_LENGTH)]],
                                    Field(max_length=MAX_STOP_STRINGS)],
                          None], WithJsonSchema(_STOP_SCHEMA)] = None
    seed: Integer(-(2**63), 2**64 - 1) | None = None  # OpenAI's are signed 64-bit
    user: str | None = None
    # vLLM's extras, accepted at the top level of the body.
    top_k: Integer(-1, INT32_MAX) | None = None
    min_tokens: Integer(0, INT32_MAX) = 0
    ignore_eos: bool = False
    stop_token_ids: list[Integer(0, INT32_MAX)] | None = Field(default=None, max_length=1024)
    cache_salt: str | None = None


class ChatCompletionRequest(_Sampling):
    # top_logprobs needs logprobs: true (checked in request_mapping.chat_request).
    model_config = ConfigDict(json_schema_extra=_schema_extra(unsupported=True, anyOf=[
        {"properties": {"top_logprobs": {"type": "null"}}},
        {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}]))

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Integer(1, INT32_MAX) | None = None
    logprobs: bool = False
    top_logprobs: Integer(0, MAX_TOP_LOGPROBS) | None = None
    kvboost: ChatKVBoostOptions | None = None


_TEXT_PROMPT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 1}],
                "description": "one text prompt (a list of one is accepted); token ids and several prompts are 400"}


class CompletionRequest(_Sampling):
    # The prompt is a text, or empty when kvboost.segments carries it (request_mapping.completion_request; a
    # prompt equal to the segments joined is accepted too, which a schema cannot say).
    model_config = ConfigDict(json_schema_extra=_schema_extra(unsupported=True, anyOf=[
        {"properties": {"prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                             {"type": "array", "items": {"type": "string", "minLength": 1},
                                              "minItems": 1}]},
                        "kvboost": {"anyOf": [{"type": "null"}, {"properties": {"segments": {"type": "null"}}}]}}},
        {"properties": {"prompt": {"anyOf": [{"const": ""}, {"type": "array", "items": {"const": ""}}]},
                        "kvboost": {"type": "object", "required": ["segments"],
                                    "properties": {"segments": {"type": "array"}}}},
         "required": ["kvboost"]}]))

    prompt: Annotated[Union[str, list[str], list[TokenId], list[list[TokenId]]], WithJsonSchema(_TEXT_PROMPT)]
    echo: bool = False
    logprobs: Integer(0, MAX_TOP_LOGPROBS) | None = None
    kvboost: KVBoostOptions | None = None


class CompletionRenderRequest(CompletionRequest):
    """A completion's render (/v1/completions/render): a text prompt only; kvboost.segments are tokenized one by
    one, so their ids are no single prompt's and the schema says they stay null."""

    model_config = ConfigDict(json_schema_extra=_schema_extra(unsupported=True, anyOf=[
        {"properties": {"prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                             {"type": "array", "items": {"type": "string", "minLength": 1},
                                              "minItems": 1}]}}}]))

    kvboost: ChatKVBoostOptions | None = None


class TokenizeRequest(_Body):
    # Exactly one of a non-empty prompt and non-empty messages (request_mapping.tokenize_request).
    model_config = ConfigDict(json_schema_extra=_schema_extra(oneOf=[
        {"properties": {"prompt": {"type": "string", "minLength": 1}}, "required": ["prompt"]},
        {"properties": {"messages": {"type": "array", "minItems": 1}}, "required": ["messages"]}]))

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # Refused when true (request_mapping.tokenize_request), so the schema says false is the one value served.
    continue_final_message: bool = Field(False, json_schema_extra=neutral_schema((False,)))
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


class UnpinRequest(_Body):
    """The text or messages of an earlier warm-up, whose pinned chunks become evictable again."""

    # Exactly one of a non-empty text and non-empty messages (request_mapping.warm_request).
    model_config = ConfigDict(json_schema_extra=_schema_extra(oneOf=[
        {"properties": {"text": {"type": "string", "minLength": 1}}, "required": ["text"]},
        {"properties": {"messages": {"type": "array", "minItems": 1}}, "required": ["messages"]}]))

    model: str | None = None
    text: str | None = None
    messages: list[ChatMessageIn] | None = None
    content_addressed: bool = False
    cache_salt: str | None = None
    tenant: str | None = None  # admin keys only: act in this tenant's cache scope


class WarmRequest(UnpinRequest):
    pin: bool = False  # admin keys only
