"""Translations between the inference.proto messages and the engine's own types (no logic of their own)."""
from __future__ import annotations

import time
from typing import Any, Mapping

from inference_service.engine_parts.types import GenerationOutcome, GenerationParams, TokenEvent, TokenLogprob, WarmOutcome
from inference_service.errors import InvalidRequest
from kvboost.v1 import inference_pb2 as pb
from kvboost_common.request_ids import new_request_id

DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_VERIFY_TOKENS = 32


def mode_name(value: int) -> str | None:
    """Mode enum -> engine mode name; None for MODE_UNSPECIFIED (the server default)."""
    return None if value == pb.MODE_UNSPECIFIED else _enum_name(pb.Mode, "mode", value)


def mode_value(name: str) -> int:
    return pb.Mode.Value(name.upper())


def strategy_name(value: int) -> str | None:
    return None if value == pb.RECOMPUTE_STRATEGY_UNSPECIFIED else _enum_name(pb.RecomputeStrategy, "recompute_strategy", value)


def strategy_value(name: str) -> int:
    return pb.RecomputeStrategy.Value(name.upper())


def _enum_name(enum: Any, field: str, value: int) -> str:
    """Lower-case name of a known value; proto3 enums are open, so a client may send any number."""
    if value not in enum.values():
        known = ", ".join(f"{name}={number}" for name, number in enum.items() if number)
        raise InvalidRequest(f"{field} {value} is not one of {known}")
    return enum.Name(value).lower()


def generation_params(request: pb.GenerateRequest, arrival: float | None = None) -> GenerationParams:
    """Raises errors.InvalidRequest (from GenerationParams) on a malformed request."""
    return GenerationParams(
        prompt=request.prompt or None,
        messages=tuple((m.role, m.content) for m in request.messages) or None,
        segments=tuple(request.segments) or None,
        max_new_tokens=request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        mode=mode_name(request.mode),
        temperature=request.temperature,
        top_p=request.top_p if request.HasField("top_p") else 1.0,
        top_k=request.top_k if request.HasField("top_k") else 0,
        seed=request.seed if request.HasField("seed") else None,
        stop=tuple(request.stop),
        recompute_strategy=strategy_name(request.recompute_strategy),
        recompute_ratio=request.recompute_ratio if request.HasField("recompute_ratio") else None,
        selective_tokens=request.selective_tokens if request.HasField("selective_tokens") else None,
        sink_tokens=request.sink_tokens if request.HasField("sink_tokens") else None,
        request_id=new_request_id(request.request_id),
        arrival=time.perf_counter() if arrival is None else arrival,
        logprobs=request.top_logprobs if request.logprobs else None,
        prompt_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
        n=request.n or 1,
        cache_salt=request.cache_salt,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop_token_ids=tuple(request.stop_token_ids),
        strict_context=request.strict_context,
    )


def batch_params(request: pb.GenerateBatchRequest, arrival: float) -> list[GenerationParams]:
    """Raises errors.InvalidRequest naming the malformed request's index."""
    batch = []
    for index, item in enumerate(request.requests):
        try:
            batch.append(generation_params(item, arrival))
        except InvalidRequest as error:
            raise InvalidRequest(f"requests[{index}]: {error}") from None
    return batch


def generation_result(outcome: GenerationOutcome) -> pb.GenerationResult:
    fields = _shared_fields(pb.GenerationResult, outcome)
    fields["mode"] = mode_value(outcome.mode)
    return pb.GenerationResult(**fields)


def token_event(event: TokenEvent) -> pb.GenerateEvent:
    return pb.GenerateEvent(text=event.text, token_ids=event.token_ids, index=event.index,
                            logprobs=[token_logprob(item) for item in event.logprobs],
                            prompt_logprobs=[token_logprob(item) for item in event.prompt_logprobs],
                            approximate=event.approximate, approximate_tokens=event.approximate_tokens)


def token_logprob(item: TokenLogprob) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=alt.token_id, text=alt.text, logprob=alt.logprob) for alt in item.top]
    return pb.TokenLogprob(token_id=item.token_id, text=item.text, logprob=item.logprob, top=top)


def final_event(outcome: GenerationOutcome) -> pb.GenerateEvent:
    return pb.GenerateEvent(result=generation_result(outcome), index=outcome.index)


def warm_result(outcome: WarmOutcome) -> pb.WarmResult:
    return pb.WarmResult(**_shared_fields(pb.WarmResult, outcome))


def warm_arguments(request: pb.WarmRequest) -> dict[str, Any]:
    """Keyword arguments of Engine.warm."""
    return {
        "text": request.text,
        "messages": tuple((m.role, m.content) for m in request.messages) or None,
        "content_addressed": request.content_addressed,
        "pin": request.pin,
        "cache_salt": request.cache_salt,
    }


def tokenize_arguments(request: pb.TokenizeRequest) -> dict[str, Any]:
    """Keyword arguments of Engine.tokenize; unset flags default to how Generate tokenizes."""
    return {
        "prompt": request.prompt or None,
        "messages": tuple((m.role, m.content) for m in request.messages) or None,
        "add_special_tokens": request.add_special_tokens if request.HasField("add_special_tokens") else True,
        "add_generation_prompt": request.add_generation_prompt if request.HasField("add_generation_prompt") else True,
    }


def tokenize_reply(token_ids: list[int], tokens: list[str], max_context: int) -> pb.TokenizeReply:
    return pb.TokenizeReply(token_ids=token_ids, tokens=tokens, max_context=max_context)


def verify_arguments(request: pb.VerifyRequest) -> dict[str, Any]:
    """Keyword arguments of Engine.verify; unset fields take the documented defaults."""
    return {
        "prompts": list(request.prompts),
        "max_new_tokens": request.max_new_tokens or DEFAULT_VERIFY_TOKENS,
        "mode": mode_name(request.mode) or "prefix_cache",
    }


def verify_report(rows: list[Mapping[str, Any]]) -> pb.VerifyReport:
    prompts = [pb.PromptVerification(**_shared_fields(pb.PromptVerification, row)) for row in rows]
    return pb.VerifyReport(prompts=prompts, identical=sum(p.token_identical for p in prompts), total=len(prompts))


def model_info_reply(info: Mapping[str, Any]) -> pb.ModelInfoReply:
    fields = _shared_fields(pb.ModelInfoReply, info)
    strategy = fields.get("default_recompute_strategy")
    if isinstance(strategy, str):
        fields["default_recompute_strategy"] = strategy_value(strategy)
    if isinstance(fields.get("default_mode"), str):
        fields["default_mode"] = mode_value(fields["default_mode"])
    return pb.ModelInfoReply(**fields)


def stats_reply(engine_stats: Mapping[str, Any], **service_fields: Any) -> pb.ServiceStatsReply:
    """Engine counters plus the serving layer's own (degraded, queue depth, address, rejections)."""
    fields = _shared_fields(pb.ServiceStatsReply, engine_stats)
    fields["tier_loads"] = [pb.TierLoad(tier=tier, **_shared_fields(pb.TierLoad, counters))
                            for tier, counters in (engine_stats.get("tier_loads") or {}).items()]
    fields.update(service_fields)
    return pb.ServiceStatsReply(**fields)


def _shared_fields(message_type: Any, source: Any) -> dict[str, Any]:
    """The values of `source` (a mapping or an object) for every field name `message_type` has."""
    names = message_type.DESCRIPTOR.fields_by_name
    if isinstance(source, Mapping):
        return {name: source[name] for name in names if source.get(name) is not None}
    return {name: getattr(source, name) for name in names if getattr(source, name, None) is not None}
