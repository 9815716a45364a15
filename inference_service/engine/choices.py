"""n completions of one prompt: one prefill (cache reuse included), then the n rows decoded together.

The prompt's K/V are copied into every row of a padded batch without pads (all rows have the same
prompt), each row samples its first token from the same prefill logits with its own generator (seed + row),
and the rows leave the batch as they finish. Models with sliding-window layers cannot use the batch
layout: their choices run one after another (each its own prefill), as separate requests would.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from inference_service.engine.assembler import empty_context
from inference_service.engine.generation import DecodeResult, OnToken, SamplingSettings, finish_reason, pick_token
from inference_service.engine.logprobs import token_logprobs
from inference_service.engine.pipeline import (
    EngineParts, Prefilled, ShouldStop, cancelled_before_start, for_request, generate_one, outcome_of, plan_request,
    prefill_prompt, record_outcome, repair_options, submit_write_back,
)
from inference_service.engine.types import GenerationOutcome, GenerationParams, TokenEvent
from inference_service.model import batch_forward
from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.model.sampling import make_generator


@dataclass(slots=True)
class _Choice:
    """One row's decoding state."""

    index: int
    settings: SamplingSettings
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    first_token_time: float = 0.0
    last_token_time: float = 0.0


def generate_choices(parts: EngineParts, params: GenerationParams, on_token: OnToken | None = None,
                     should_stop: ShouldStop = lambda: False) -> list[GenerationOutcome]:
    """params.n completions of one prompt, in index order; events carry the choice's index.

    Raises:
        InvalidRequest, PromptTooLong: as pipeline.generate_one.
    """
    if params.n == 1:
        return [generate_one(parts, params, on_token, should_stop)[0]]
    if batch_forward.has_sliding_layers(parts.model.config):
        return _one_after_another(parts, params, on_token, should_stop)
    parts = for_request(parts, params)
    mode, prompt, max_new_tokens = plan_request(parts, params)
    if should_stop():  # cancelled or past its deadline while queued
        return [record_outcome(parts, params, mode, prompt, empty_context(), 0, cancelled_before_start(), index=i)
                for i in range(params.n)]
    prefilled = prefill_prompt(parts, prompt, mode, prompt.num_tokens + max_new_tokens, params.request_id,
                               repair_options(parts, params), num_prompt_logprobs=params.prompt_logprobs)
    if prefilled.prompt_logprobs and on_token is not None:
        on_token(TokenEvent("", (), prompt_logprobs=prefilled.prompt_logprobs))
    choices = [_new_choice(parts, params, prompt.token_ids, index) for index in range(params.n)]
    _decode(parts, prefilled, choices, max_new_tokens, on_token, should_stop)
    outcomes = []
    for choice in choices:
        decoded = DecodeResult(choice.token_ids, choice.detokenizer.text, choice.finish_reason,
                               choice.first_token_time, choice.last_token_time)
        if choice.index == 0:  # the request counts once: one prompt, one prefill
            outcomes.append(record_outcome(parts, params, mode, prompt, prefilled.context,
                                           prefilled.num_cached_tokens, decoded, label=f" {params.n} choices"))
        else:
            outcomes.append(outcome_of(params, mode, prompt.num_tokens, prefilled.num_cached_tokens,
                                       prefilled.context.num_recomputed_tokens, decoded, prefilled.context.degraded,
                                       choice.index))
    return outcomes


def _new_choice(parts: EngineParts, params: GenerationParams, prompt_ids: Sequence[int], index: int) -> _Choice:
    settings = SamplingSettings.of(params, choice=index)
    generator = make_generator(settings.seed, parts.device) if settings.temperature > 0 else None
    return _Choice(index, settings, IncrementalDetokenizer(parts.tokenizer, prompt_ids, params.stop), generator)


def _decode(parts: EngineParts, prefilled: Prefilled, choices: list[_Choice], max_new_tokens: int,
            on_token: OnToken | None, should_stop: ShouldStop) -> None:
    num_prompt = prefilled.prompt.num_tokens
    # keys: [layers, kv_heads, capacity, head_dim]; the prompt's rows [0, num_prompt) are set.
    keys = prefilled.key_buffer[:, :, :num_prompt]
    values = prefilled.value_buffer[:, :, :num_prompt]
    batch = batch_forward.allocate_batch(parts.model.config, parts.geometry, len(choices),
                                         num_prompt + max_new_tokens, keys, values, parts.device, parts.dtype)
    batch.pads = [0] * len(choices)  # same prompt in every row: nothing to pad
    logits = prefilled.first_logits.unsqueeze(0).expand(len(choices), -1)  # [rows, vocab]
    active = list(choices)  # in buffer order
    first_step = True
    while True:
        now = time.perf_counter()
        for slot, choice in enumerate(active):
            _step(parts, choice, logits[slot], now, max_new_tokens, on_token, should_stop)
        if first_step:
            submit_write_back(parts, prefilled.pending)
            first_step = False
        kept = [slot for slot, choice in enumerate(active) if not choice.finish_reason]
        if not kept:
            return
        if len(kept) < len(active):  # finished rows leave the batch
            batch_forward.keep_rows(parts.model.config, batch, kept)
            active = [active[slot] for slot in kept]
        logits = batch_forward.decode_rows(parts.model, batch, [choice.token_ids[-1] for choice in active],
                                           [num_prompt + len(choice.token_ids) - 1 for choice in active])


def _step(parts: EngineParts, choice: _Choice, logits: torch.Tensor, now: float, max_new_tokens: int,
          on_token: OnToken | None, should_stop: ShouldStop) -> None:
    """Samples one token for the choice (logits: [vocab]), streams it, and notes when the choice ends."""
    settings = choice.settings
    eos_ids = settings.eos_ids(parts.eos_ids)
    token, used_logits = pick_token(logits, settings, choice.generator, len(choice.token_ids), eos_ids)
    token_id = int(token)
    choice.token_ids.append(token_id)
    choice.first_token_time = choice.first_token_time or now
    choice.last_token_time = now
    piece = choice.detokenizer.add(token_id)
    choice.finish_reason = finish_reason(token_id, choice.detokenizer, eos_ids, len(choice.token_ids),
                                         max_new_tokens, should_stop, settings.stop_token_ids)
    rest = choice.detokenizer.finish() if choice.finish_reason else ""
    if on_token is not None:
        logprobs = () if settings.logprobs is None else tuple(
            token_logprobs(parts.tokenizer, used_logits.view(1, -1), [token_id], settings.logprobs))
        on_token(TokenEvent(piece, (token_id,), logprobs, choice.index))
        if rest:
            on_token(TokenEvent(rest, (), (), choice.index))


def _one_after_another(parts: EngineParts, params: GenerationParams, on_token: OnToken | None,
                       should_stop: ShouldStop) -> list[GenerationOutcome]:
    outcomes = []
    for index in range(params.n):
        single = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index,
                                     prompt_logprobs=params.prompt_logprobs if index == 0 else None)

        def relabel(event: TokenEvent, index: int = index) -> None:
            on_token(dataclasses.replace(event, index=index))

        outcome = generate_one(parts, single, relabel if on_token is not None else None, should_stop)[0]
        outcome.index = index
        outcomes.append(outcome)
    return outcomes
