"""The decode loop: pick a token, stream its text, stop on EOS, a stop string or token, the length limit or cancellation."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from inference_service.engine.logprobs import token_logprobs
from inference_service.engine.types import GenerationParams, TokenEvent
from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.model.forward import decode_step
from inference_service.model.sampling import make_generator, sample, suppress_tokens

OnToken = Callable[[TokenEvent], None]


@dataclass(slots=True, frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and k alternatives
    min_tokens: int = 0  # ending tokens (EOS, stop_token_ids) are suppressed before this many
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, params: GenerationParams, choice: int = 0) -> SamplingSettings:
        """A request's settings; choice i of n > 1 samples with seed + i, so the choices differ."""
        seed = None if params.seed is None else params.seed + choice
        return cls(params.temperature, params.top_k, params.top_p, seed, params.logprobs, params.min_tokens,
                   params.ignore_eos, frozenset(params.stop_token_ids))

    def eos_ids(self, model_eos_ids: frozenset[int]) -> frozenset[int]:
        """The EOS ids that end this request (none with ignore_eos)."""
        return frozenset() if self.ignore_eos else model_eos_ids


@dataclass(slots=True)
class DecodeResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    first_token_time: float  # perf_counter when the first token was chosen (0.0 when none was)
    last_token_time: float


def pick_token(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None,
               num_generated: int, eos_ids: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [], the logits it was sampled from) for logits [vocab]; ending tokens held off before min_tokens."""
    if num_generated < settings.min_tokens:
        logits = suppress_tokens(logits, eos_ids | settings.stop_token_ids)
    return sample(logits, settings.temperature, settings.top_k, settings.top_p, generator), logits


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
    tokenizer=None,
) -> DecodeResult:
    """Generates from the prefill's logits (first_logits: [vocab]); `position` is the first new token's position.

    on_token(event) is called once per token with the text it completes (maybe empty) and once more
    with no token ids if text was held back at the end; the pieces concatenate to the output.
    tokenizer: decodes the tokens named in logprobs (needed when settings.logprobs is set).
    """
    generator = make_generator(settings.seed, first_logits.device) if settings.temperature > 0 else None
    eos_ids = settings.eos_ids(eos_ids)
    token_ids: list[int] = []
    logits = first_logits
    first_time = 0.0
    while True:
        token, used_logits = pick_token(logits, settings, generator, len(token_ids), eos_ids)
        token_id = int(token)
        token_ids.append(token_id)
        now = time.perf_counter()
        first_time = first_time or now
        piece = detokenizer.add(token_id)
        if on_token is not None:
            logprobs = () if settings.logprobs is None else tuple(
                token_logprobs(tokenizer, used_logits.view(1, -1), [token_id], settings.logprobs))
            on_token(TokenEvent(piece, (token_id,), logprobs))
        if len(token_ids) == 1:
            after_first_token()
        reason = finish_reason(token_id, detokenizer, eos_ids, len(token_ids), max_new_tokens, should_stop,
                               settings.stop_token_ids)
        if reason:
            break
        logits = decode_step(model, cache, token, position + len(token_ids) - 1)
    rest = detokenizer.finish()
    if rest and on_token is not None:
        on_token(TokenEvent(rest, ()))
    return DecodeResult(token_ids, detokenizer.text, reason, first_time, now)


def finish_reason(token_id: int, detokenizer: IncrementalDetokenizer, eos_ids: frozenset[int],
                  num_generated: int, max_new_tokens: int, should_stop: Callable[[], bool],
                  stop_token_ids: frozenset[int] = frozenset()) -> str:
    if token_id in eos_ids:
        return "eos"
    if detokenizer.stopped or token_id in stop_token_ids:
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
