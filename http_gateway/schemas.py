"""Request bodies as pydantic models: OpenAI's fields, vLLM's extras, and KVBoost's own under `kvboost`.

Unknown fields are kept (extra="allow") so request_mapping.py can refuse the known but unsupported ones by
name; everything else unknown is ignored, as OpenAI does.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 16  # the service's limit on n
MAX_TOP_LOGPROBS = 20
UINT32_MAX = 2**32 - 1  # the proto's counts and token ids
# Below this a temperature is no distribution a float32 sampler can draw from reliably (logits / T overflow):
# send 0 for greedy decoding.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 64  # stop strings per request, each at most MAX_STOP_LENGTH characters
MAX_STOP_LENGTH = 1024

Count = Annotated[int, Field(ge=0, le=UINT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class KVBoostOptions(BaseModel):
    """KVBoost's own options, sent as {"kvboost": {...}} (the openai SDK's extra_body)."""

    model_config = ConfigDict(extra="forbid")  # our own names: a typo is an error, not silence

    mode: Literal["baseline", "prefix_cache", "chunk_kv_reuse"] | None = None
    segments: list[str] | None = Field(default=None, min_length=1)
    recompute_strategy: Literal["none", "selective", "cacheblend"] | None = None
    recompute_ratio: float | None = Field(default=None, gt=0, le=1)
    selective_tokens: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    sink_tokens: int | None = Field(default=None, ge=0, le=UINT32_MAX)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class _Sampling(_Body):
    """Fields chat and completions share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[Annotated[str, Field(max_length=MAX_STOP_LENGTH)],
                Annotated[list[Annotated[str, Field(max_length=MAX_STOP_LENGTH)]], Field(max_length=MAX_STOP_STRINGS)],
                None] = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # OpenAI's are signed 64-bit
    user: str | None = None
    # vLLM's extras, accepted at the top level of the body.
    top_k: int | None = Field(default=None, ge=-1, le=UINT32_MAX)
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=1024)
    cache_salt: str | None = None
    kvboost: KVBoostOptions | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


class UnpinRequest(_Body):
    """The text or messages of an earlier warm-up, whose pinned chunks become evictable again."""

    model: str | None = None
    text: str | None = None
    messages: list[ChatMessageIn] | None = None
    content_addressed: bool = False
    cache_salt: str | None = None
    tenant: str | None = None  # admin keys only: act in this tenant's cache scope


class WarmRequest(UnpinRequest):
    pin: bool = False  # admin keys only
