"""kvboost.v1 events and results -> OpenAI response bodies and stream chunks (pure; no I/O)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from kvboost.v1 import inference_pb2 as pb

# The service's finish reasons in OpenAI's words ("abort" as vLLM says it for a stopped request).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}


def finish_reason(result: pb.GenerationResult) -> str:
    return FINISH_REASONS.get(result.finish_reason, result.finish_reason or "stop")


def usage(results: Iterable[pb.GenerationResult]) -> dict:
    """OpenAI usage; the prompt counts once for n choices, cached_tokens is always there (0 when none)."""
    results = list(results)
    first = results[0] if results else pb.GenerationResult()
    completion_tokens = sum(result.generated_tokens for result in results)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": first.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def kvboost_details(result: pb.GenerationResult) -> dict:
    """KVBoost's own figures of a request (an extra key OpenAI clients ignore)."""
    return {
        "mode": pb.Mode.Name(result.mode).lower(),
        "ttft_ms": round(result.ttft_ms, 3),
        "kv_reuse_ratio": round(result.kv_reuse_ratio, 4),
        "cached_tokens": result.cached_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "degraded": result.degraded,
        # K/V computed under another prefix (content hits, mode chunk_kv_reuse) went into the answer: it may differ
        # from the answer without the cache. False: the cache changed nothing but the time.
        "approximate": result.approximate,
        "approximate_tokens": result.approximate_tokens,
        "request_id": result.request_id,
    }


def kvboost_prefill_details(event: pb.GenerateEvent) -> dict:
    """What a stream's first content chunk says of the prompt: whether the answer that follows is approximate."""
    return {"approximate": event.approximate, "approximate_tokens": event.approximate_tokens}


# ---- logprobs -----------------------------------------------------------------------------------------

def chat_logprob_items(items: Iterable[pb.TokenLogprob]) -> list[dict]:
    """Chat's logprobs.content entries."""
    return [{
        "token": item.text,
        "logprob": item.logprob,
        "bytes": list(item.text.encode("utf-8")),
        "top_logprobs": [{"token": alt.text, "logprob": alt.logprob, "bytes": list(alt.text.encode("utf-8"))}
                         for alt in item.top],
    } for item in items]


def completion_logprobs(items: Iterable[pb.TokenLogprob], text_offset: int = 0) -> dict:
    """Completions' logprobs object; text_offset: where the first token's text starts in the choice's text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for item in items:
        tokens.append(item.text)
        scored = item.HasField("logprob")
        token_logprobs.append(item.logprob if scored else None)
        top_logprobs.append({alt.text: alt.logprob for alt in item.top} if scored else None)
        offsets.append(text_offset)
        text_offset += len(item.text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


# ---- whole responses ----------------------------------------------------------------------------------

@dataclass(slots=True)
class _Choice:
    pieces: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    result: pb.GenerationResult | None = None


@dataclass(slots=True)
class Collected:
    """A Generate stream read to its end: per choice text, logprobs and result."""

    n: int
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)

    def add(self, event: pb.GenerateEvent) -> None:
        choice = self.choices.setdefault(event.index, _Choice())
        self.prompt_logprobs.extend(event.prompt_logprobs)
        if event.HasField("result"):
            choice.result = event.result
            return
        choice.pieces.append(event.text)
        choice.logprobs.extend(event.logprobs)

    def ordered(self) -> list[_Choice]:
        return [self.choices.get(index, _Choice()) for index in range(self.n)]

    def results(self) -> list[pb.GenerationResult]:
        return [choice.result for choice in self.ordered() if choice.result is not None]


def chat_completion(response_id: str, created: int, model: str, collected: Collected, logprobs: bool) -> dict:
    results = collected.results()
    return {
        "id": response_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": index,
            "message": {"role": "assistant", "content": "".join(choice.pieces)},
            "logprobs": {"content": chat_logprob_items(choice.logprobs), "refusal": None} if logprobs else None,
            "finish_reason": finish_reason(choice.result) if choice.result else "abort",
        } for index, choice in enumerate(collected.ordered())],
        "usage": usage(results),
        "system_fingerprint": None,
        "kvboost": kvboost_details(results[0]) if results else None,
    }


def completion(response_id: str, created: int, model: str, collected: Collected, echo_prompt: str | None,
               logprobs: bool) -> dict:
    results = collected.results()
    choices = []
    for index, choice in enumerate(collected.ordered()):
        prefix = echo_prompt or ""
        scored = (collected.prompt_logprobs if echo_prompt is not None else []) + choice.logprobs
        choices.append({
            "index": index,
            "text": prefix + "".join(choice.pieces),
            "logprobs": completion_logprobs(scored) if logprobs else None,
            "finish_reason": finish_reason(choice.result) if choice.result else "abort",
        })
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(results), "system_fingerprint": None,
            "kvboost": kvboost_details(results[0]) if results else None}
