"""Continuous batching: requests join the running batch between decode steps and leave as each one ends.

The scheduler is driven by the model worker thread: `submit` queues a request, every `step` spends a
bounded prefill budget on joining requests (prefix hits, content-hit repair and the uncached suffix in
pieces, through the same pipeline as a single request; then the first token and its write-back) and
then runs ONE batched decode step for every running request. Each
request keeps its own mode, sampler, seed, stop strings and length limit (a RowDecoder per request).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from inference_service.engine.assembler import empty_context
from inference_service.engine.chunked_prefill import ChunkedPrefill
from inference_service.engine.generation import OnToken, RowDecoder, SamplingSettings
from inference_service.engine.pipeline import (
    EngineParts, Prefilled, cancelled_before_start, for_request, plan_request, record_outcome, repair_options,
    submit_write_back,
)
from inference_service.engine.prompts import PromptPlan
from inference_service.engine.types import GenerationOutcome, GenerationParams, TokenEvent
from inference_service.model.batch_forward import has_sliding_layers
from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.model.running_batch import RunningBatch

logger = logging.getLogger(__name__)

OnDone = Callable[[GenerationOutcome | None, BaseException | None], None]


@dataclass(slots=True, frozen=True)
class SchedulerLimits:
    max_running_requests: int = 16  # rows decoded together
    max_batch_tokens: int = 65536  # prompt + max_new_tokens summed over running rows (a lone row always runs)
    max_prefill_tokens: int = 512  # prompt tokens prefilled per step before the running rows decode again

    def __post_init__(self) -> None:
        assert self.max_running_requests > 0, f"max_running_requests must be positive, got {self.max_running_requests}"
        assert self.max_batch_tokens > 0, f"max_batch_tokens must be positive, got {self.max_batch_tokens}"
        assert self.max_prefill_tokens > 0, f"max_prefill_tokens must be positive, got {self.max_prefill_tokens}"


@dataclass(slots=True)
class StreamRequest:
    """One Generate request (n = 1) handed to the scheduler; on_done(outcome, error) is called once."""

    params: GenerationParams
    on_token: OnToken | None
    should_stop: Callable[[], bool]
    on_done: OnDone
    # Set when planned (the first time the scheduler looks at it).
    parts: EngineParts | None = None
    mode: str = ""
    prompt: PromptPlan | None = None
    max_new_tokens: int = 0

    @property
    def num_reserved_tokens(self) -> int:
        return self.prompt.num_tokens + self.max_new_tokens


@dataclass(slots=True)
class RunningRow:
    request: StreamRequest
    prefilled: Prefilled
    decoder: RowDecoder
    next_token_id: int = 0
    next_position: int = 0


@dataclass
class Scheduler:
    parts: EngineParts
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    waiting: deque = field(default_factory=deque)
    rows: dict = field(default_factory=dict)  # slot -> RunningRow
    prefilling: list = field(default_factory=list)  # (StreamRequest, ChunkedPrefill), oldest first
    num_steps: int = 0

    def __post_init__(self) -> None:
        assert not has_sliding_layers(self.parts.model.config), "continuous batching needs full-attention layers"
        self.batch = RunningBatch(self.parts.model.config, self.parts.geometry, self.parts.device, self.parts.dtype)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_reserved_tokens(self) -> int:
        """Prompt + max_new_tokens of every request running or prefilling."""
        return (sum(row.request.num_reserved_tokens for row in self.rows.values())
                + sum(request.num_reserved_tokens for request, _ in self.prefilling))

    def submit(self, request: StreamRequest) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.rows or self.prefilling)

    def step(self) -> None:
        """Admits waiting requests that fit, then decodes one token for every running request."""
        self._admit()
        if self.rows:
            self._decode()
        moved = self.batch.maybe_compact()
        if moved:
            self.rows = {moved[slot]: row for slot, row in self.rows.items()}
        self.num_steps += 1

    def fail_waiting(self, error: BaseException) -> None:
        while self.waiting:
            self.waiting.popleft().on_done(None, error)

    def fail_all(self, error: BaseException) -> None:
        """Ends every request with `error` and starts over with an empty batch (after a failed step)."""
        self.fail_waiting(error)
        rows, self.rows = self.rows, {}
        prefilling, self.prefilling = self.prefilling, []
        for request in [row.request for row in rows.values()] + [request for request, _ in prefilling]:
            request.on_done(None, error)
        self.batch = RunningBatch(self.parts.model.config, self.parts.geometry, self.parts.device, self.parts.dtype)

    # ---- admission ------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Spends this step's prefill budget: first on prefills under way, then on waiting requests that fit."""
        budget = self.limits.max_prefill_tokens
        for request, prefill in list(self.prefilling):
            if budget <= 0:
                return
            budget -= self._advance(request, prefill, budget)
        while self.waiting and budget > 0 and self.num_running + len(self.prefilling) < self.limits.max_running_requests:
            request = self.waiting[0]
            try:
                _maybe_plan(self.parts, request)
            except Exception as error:  # bad request: only this one fails
                self.waiting.popleft().on_done(None, error)
                continue
            over_budget = self.num_reserved_tokens + request.num_reserved_tokens > self.limits.max_batch_tokens
            if (self.rows or self.prefilling) and over_budget:
                return  # waits for running requests to finish
            self.waiting.popleft()
            if request.should_stop():  # cancelled or past its deadline while waiting
                request.on_done(record_outcome(request.parts, request.params, request.mode, request.prompt,
                                               empty_context(), 0, cancelled_before_start()), None)
                continue
            try:
                prefill = ChunkedPrefill(request.parts, request.prompt, request.mode,
                                         request.num_reserved_tokens, request.params.request_id,
                                         repair_options(request.parts, request.params), request.params.prompt_logprobs)
            except Exception as error:
                self._fail(request, error)
                continue
            self.prefilling.append((request, prefill))
            budget -= self._advance(request, prefill, budget)

    def _advance(self, request: StreamRequest, prefill: ChunkedPrefill, budget: int) -> int:
        """Runs one piece of the request's prefill; when it is done, the request picks its first token and joins."""
        try:
            num_run = prefill.advance(budget)
        except Exception as error:
            self.prefilling.remove((request, prefill))
            self._fail(request, error)
            return 0
        if prefill.done is not None:
            self.prefilling.remove((request, prefill))
            self._join(request, prefill.done)
        return num_run

    def _join(self, request: StreamRequest, prefilled: Prefilled) -> None:
        parts, params, prompt = request.parts, request.params, request.prompt
        if prefilled.prompt_logprobs and request.on_token is not None:
            request.on_token(TokenEvent("", (), prompt_logprobs=prefilled.prompt_logprobs))
        decoder = RowDecoder(
            IncrementalDetokenizer(parts.tokenizer, prompt.token_ids, params.stop), SamplingSettings.of(params),
            parts.eos_ids, request.max_new_tokens, request.on_token, request.should_stop,
            after_first_token=lambda: submit_write_back(parts, prefilled.pending), tokenizer=parts.tokenizer,
            device=parts.device)
        row = RunningRow(request, prefilled, decoder)
        row.next_token_id = int(decoder.take(prefilled.first_logits))
        row.next_position = prompt.num_tokens
        if decoder.reason:
            self._finish(row)
            return
        length = prompt.num_tokens
        slot = self.batch.add(prefilled.key_buffer[:, :, :length], prefilled.value_buffer[:, :, :length])
        # The batch holds the row's K/V now; the write-back keeps its own views until it has stored them.
        prefilled.key_buffer = prefilled.value_buffer = prefilled.cache = None
        self.rows[slot] = row

    def _fail(self, request: StreamRequest, error: BaseException) -> None:
        logger.exception("[%s] prefill failed", request.params.request_id, exc_info=error)
        request.on_done(None, error)

    # ---- decoding -------------------------------------------------------------------------------

    def _decode(self) -> None:
        num_slots = self.batch.num_slots
        token_ids, positions = [0] * num_slots, [0] * num_slots
        for slot, row in self.rows.items():
            token_ids[slot], positions[slot] = row.next_token_id, row.next_position
        logits = self.batch.decode(self.parts.model, token_ids, positions)  # [slots, vocab]
        for slot, row in list(self.rows.items()):
            row.next_token_id = int(row.decoder.take(logits[slot]))
            row.next_position += 1
            if row.decoder.reason:
                del self.rows[slot]
                self.batch.release(slot)
                self._finish(row)

    def _finish(self, row: RunningRow) -> None:
        request, prefilled = row.request, row.prefilled
        decoded = row.decoder.finish()
        outcome = record_outcome(request.parts, request.params, request.mode, request.prompt, prefilled.context,
                                 prefilled.num_cached_tokens, decoded)
        request.on_done(outcome, None)


def _maybe_plan(parts: EngineParts, request: StreamRequest) -> None:
    if request.prompt is None:
        request.parts = for_request(parts, request.params)
        request.mode, request.prompt, request.max_new_tokens = plan_request(request.parts, request.params)
