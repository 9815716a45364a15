"""Small builders of kvboost.v1 events for the gateway's pure tests."""
from __future__ import annotations

from kvboost.v1 import inference_pb2 as pb


def logprob(token_id: int, text: str, value: float | None, top: tuple = ()) -> pb.TokenLogprob:
    item = pb.TokenLogprob(token_id=token_id, text=text,
                           top=[pb.TopLogprob(token_id=i, text=t, logprob=v) for i, t, v in top])
    if value is not None:
        item.logprob = value
    return item


def token(text: str, token_id: int, index: int = 0, logprobs: tuple = ()) -> pb.GenerateEvent:
    return pb.GenerateEvent(text=text, token_ids=[token_id], index=index, logprobs=list(logprobs))


def result(index: int = 0, generated: int = 2, finish: str = "length", prompt: int = 10,
           cached: int = 4) -> pb.GenerateEvent:
    return pb.GenerateEvent(index=index, result=pb.GenerationResult(
        generated_tokens=generated, finish_reason=finish, prompt_tokens=prompt, cached_tokens=cached,
        mode=pb.PREFIX_CACHE, ttft_ms=12.5, kv_reuse_ratio=0.4, request_id="rid"))
