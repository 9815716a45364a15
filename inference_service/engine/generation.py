"""The decode loop: pick a token, stream its text, stop on EOS, a stop string, the length limit or cancellation."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.model.forward import decode_step
from inference_service.model.sampling import make_generator, sample

OnToken = Callable[[str, list[int]], None]


@dataclass(slots=True, frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(slots=True)
class DecodeResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    first_token_time: float  # perf_counter when the first token was chosen (0.0 when none was)
    last_token_time: float


def decode_loop(
    model,
    cache: DynamicCache,
    first_logits: torch.Tensor,
    position: int,
    detokenizer: IncrementalDetokenizer,
    settings: SamplingSettings,
    eos_ids: frozenset[int],
    max_new_tokens: int,
    on_token: OnToken | None,
    should_stop: Callable[[], bool],
    after_first_token: Callable[[], None],
) -> DecodeResult:
    """Generates from the prefill's logits (first_logits: [vocab]); `position` is the first new token's position.

    on_token(text, token_ids) is called once per token with the text it completes (maybe empty) and
    once more with token_ids [] if text was held back at the end; the pieces concatenate to the output.
    """
    generator = make_generator(settings.seed, first_logits.device) if settings.temperature > 0 else None
    token_ids: list[int] = []
    logits = first_logits
    first_time = 0.0
    while True:
        token = sample(logits, settings.temperature, settings.top_k, settings.top_p, generator)
        token_id = int(token)
        token_ids.append(token_id)
        now = time.perf_counter()
        first_time = first_time or now
        piece = detokenizer.add(token_id)
        if on_token is not None:
            on_token(piece, [token_id])
        if len(token_ids) == 1:
            after_first_token()
        reason = finish_reason(token_id, detokenizer, eos_ids, len(token_ids), max_new_tokens, should_stop)
        if reason:
            break
        logits = decode_step(model, cache, token, position + len(token_ids) - 1)
    rest = detokenizer.finish()
    if rest and on_token is not None:
        on_token(rest, [])
    return DecodeResult(token_ids, detokenizer.text, reason, first_time, now)


def finish_reason(token_id: int, detokenizer: IncrementalDetokenizer, eos_ids: frozenset[int],
                   num_generated: int, max_new_tokens: int, should_stop: Callable[[], bool]) -> str:
    if token_id in eos_ids:
        return "eos"
    if detokenizer.stopped:
        return "stop"
    if num_generated >= max_new_tokens:
        return "length"
    if should_stop():
        return "cancelled"
    return ""


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """The tokenizer's EOS id plus every EOS id of the model's generation config."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return frozenset(ids)
