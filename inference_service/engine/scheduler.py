"""Continuous batching: requests join the running batch between decode steps and leave as each one ends.

The scheduler is driven by the model worker thread: `submit` queues a request, every `step` spends a
bounded prefill budget on joining requests (prefix hits, content-hit repair and the uncached suffix in
pieces, through the same pipeline as a single request; then the first token and its write-back) and
then runs ONE batched decode step for every running row. Joining requests whose rest fits the step's
budget are prefilled together in one forward. Each request keeps its own mode, sampler, seed, stop
strings and length limit (a RowDecoder per row); a request with n > 1 completions is prefilled once and
decodes as n rows. The requests of one batch call (GenerateBatch, GenerateMany) that share leading
chunks name one SharedPrefix: fetched from the store (the rest computed) once, copied into each request.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from inference_service.engine.assembler import AssembledContext, empty_context
from inference_service.engine.chunked_prefill import ChunkedPrefill, finish_together
from inference_service.engine.generation import OnToken, RowDecoder, SamplingSettings
from inference_service.engine.pipeline import (
    EngineParts, Prefilled, cancelled_before_start, for_request, outcome_of, plan_request, record_outcome,
    repair_options, submit_write_back,
)
from inference_service.engine.prompts import PromptPlan
from inference_service.engine.types import GenerationOutcome, GenerationParams, TokenEvent
from inference_service.engine.writeback import PendingChunks
from inference_service.kv.chunking import ChunkPlan
from inference_service.model.batch_forward import has_sliding_layers
from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.model.kv_buffers import allocate_kv
from inference_service.model.running_batch import RunningBatch

logger = logging.getLogger(__name__)

# Prompt tokens per batched prefill forward, by default. On a CPU a forward is compute-bound from about
# this many tokens on (a 20-token question after a cached 737-token prompt, SmolLM2 fp32, 2 threads: 13.2 ms
# per token alone, 7.7 four in one forward, 6.8 sixteen in one: bench/bench_batch_costs.py), so larger
# forwards save little, while every request in a forward waits for all of it before its first token.
FORWARD_TOKENS = 128
UNBOUNDED = 1 << 40

# on_done(outcomes, error): once per request, with its n outcomes in index order, or None and the error.
OnDone = Callable[[list[GenerationOutcome] | None, BaseException | None], None]


@dataclass(slots=True, frozen=True)
class SchedulerLimits:
    max_running_requests: int = 16  # rows decoded together (a request with n completions takes n)
    max_batch_tokens: int = 65536  # prompt + max_new_tokens summed over running rows (a lone request always runs)
    max_prefill_tokens: int = 512  # prompt tokens prefilled per step before the running rows decode again
    max_forward_tokens: int = FORWARD_TOKENS  # prompt tokens of the joining requests batched in one forward

    def __post_init__(self) -> None:
        assert self.max_running_requests > 0, f"max_running_requests must be positive, got {self.max_running_requests}"
        assert self.max_batch_tokens > 0, f"max_batch_tokens must be positive, got {self.max_batch_tokens}"
        assert self.max_prefill_tokens > 0, f"max_prefill_tokens must be positive, got {self.max_prefill_tokens}"
        assert self.max_forward_tokens > 0, f"max_forward_tokens must be positive, got {self.max_forward_tokens}"


@dataclass(slots=True)
class SharedPrefix:
    """Leading whole chunks that several requests of one batch call share.

    Prefilled once when its first request reaches the head of the queue (the store's chunks fetched, the
    rest computed, in budgeted pieces like any prefill); each request then starts from a copy of its K/V
    instead of its own lookup. Its new chunks are stored once, and no chunk twice across the requests.
    """

    prompt: PromptPlan  # the shared chunks alone
    request_id: str
    prefill: ChunkedPrefill | None = None
    error: BaseException | None = None
    stored_keys: set = field(default_factory=set)  # chunk keys already submitted for write-back
    written_back: bool = False

    @classmethod
    def of(cls, prompt: PromptPlan, num_chunks: int, request_id: str) -> SharedPrefix:
        chunks = prompt.chunks.chunks[:num_chunks]
        num_tokens = chunks[-1].end
        plan = PromptPlan(prompt.token_ids[:num_tokens], ChunkPlan(chunks, (), num_tokens),
                          prompt.prefix_keys[:num_chunks], prompt.content_keys[:num_chunks], namespace=prompt.namespace)
        return cls(plan, request_id)

    @property
    def done(self) -> Prefilled | None:
        return None if self.prefill is None else self.prefill.done

    def start(self, parts: EngineParts) -> None:
        self.prefill = ChunkedPrefill(parts, self.prompt, "prefix_cache", self.prompt.num_tokens, self.request_id,
                                      need_logits=False)

    def context_for(self, parts: EngineParts, capacity: int) -> AssembledContext:
        """A request's starting context: its own buffers with the shared K/V copied in."""
        done, num_tokens = self.done, self.prompt.num_tokens
        keys, values = allocate_kv(parts.geometry, capacity, parts.device, parts.dtype)
        keys[:, :, :num_tokens].copy_(done.key_buffer[:, :, :num_tokens])
        values[:, :, :num_tokens].copy_(done.value_buffer[:, :, :num_tokens])
        return AssembledContext(keys, values, num_cached_tokens=num_tokens,
                                num_cached_chunks=len(self.prompt.chunks.chunks), degraded=done.context.degraded)

    def pending_once(self, pending: PendingChunks | None) -> list[PendingChunks]:
        """What one request still has to store: the shared chunks the first time, then its chunks not yet stored."""
        items = [] if self.written_back else [self.done.pending]
        self.written_back = True
        items.append(pending)
        return [kept for item in items if item is not None and (kept := item.without(self.stored_keys)) is not None]


@dataclass(slots=True)
class StreamRequest:
    """One request handed to the scheduler; on_done(outcomes, error) is called once."""

    params: GenerationParams
    on_token: OnToken | None
    should_stop: Callable[[], bool]
    on_done: OnDone
    # Set when planned (the first time the scheduler looks at it, or by the batch call that made it).
    parts: EngineParts | None = None
    mode: str = ""
    prompt: PromptPlan | None = None
    max_new_tokens: int = 0
    shared: SharedPrefix | None = None  # leading chunks it shares with other requests of its batch call
    count_fetched: bool = True  # False: the shared chunks' fetch is counted on another request of the call
    label: str = ""  # in the log line
    outcomes: list = field(default_factory=list)  # per completion index, filled as rows finish
    num_open_rows: int = 0

    @property
    def num_reserved_tokens(self) -> int:
        return self.params.n * (self.prompt.num_tokens + self.max_new_tokens)


@dataclass(slots=True)
class RunningRow:
    request: StreamRequest
    prefilled: Prefilled
    decoder: RowDecoder
    index: int = 0  # which of the request's completions
    next_token_id: int = 0
    next_position: int = 0


@dataclass
class Scheduler:
    parts: EngineParts
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    pad_token_id: int = 0  # fills the pads of a batched prefill (masked: any id gives the same output)
    waiting: deque = field(default_factory=deque)
    rows: dict = field(default_factory=dict)  # slot -> RunningRow
    prefilling: list = field(default_factory=list)  # (StreamRequest or SharedPrefix, ChunkedPrefill), oldest first
    joining: list = field(default_factory=list)  # RunningRows that picked their first token this step
    num_steps: int = 0

    def __post_init__(self) -> None:
        assert not has_sliding_layers(self.parts.model.config), "continuous batching needs full-attention layers"
        self.batch = RunningBatch(self.parts.model.config, self.parts.geometry, self.parts.device, self.parts.dtype)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Rows decoding (a request with n completions runs as n rows)."""
        return len(self.rows)

    @property
    def num_rows_in_use(self) -> int:
        return len(self.rows) + len(self.joining) + sum(owner.params.n for owner in self._prefilling_requests())

    @property
    def num_reserved_tokens(self) -> int:
        """Prompt + max_new_tokens of every row running or prefilling."""
        return (sum(row.request.num_reserved_tokens // row.request.params.n
                    for row in list(self.rows.values()) + self.joining)
                + sum(request.num_reserved_tokens for request in self._prefilling_requests()))

    def submit(self, request: StreamRequest) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.rows or self.prefilling)

    def step(self) -> None:
        """Admits waiting requests that fit, then decodes one token for every running row."""
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
        requests = {id(row.request): row.request for row in list(self.rows.values()) + self.joining}
        requests.update((id(request), request) for request in self._prefilling_requests())
        self.rows, self.prefilling, self.joining = {}, [], []
        for request in requests.values():
            request.on_done(None, error)
        self.batch = RunningBatch(self.parts.model.config, self.parts.geometry, self.parts.device, self.parts.dtype)

    def _prefilling_requests(self) -> list[StreamRequest]:
        return [owner for owner, _ in self.prefilling if isinstance(owner, StreamRequest)]

    # ---- admission ------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Spends this step's prefill budget: first on prefills under way, then on waiting requests that fit.

        A piece that ends a prefill within the budget is put aside and all of them run in one forward at
        the end; a prefill longer than what is left of the budget runs a piece alone.
        """
        budget = self.limits.max_prefill_tokens
        ending: list[tuple[object, ChunkedPrefill]] = []
        for item in list(self.prefilling):
            if budget <= 0:
                break
            budget = self._plan_piece(item, budget, ending)
        while self.waiting and budget > 0:
            request = self.waiting[0]
            try:
                _maybe_plan(self.parts, request)
            except Exception as error:  # bad request: only this one fails
                self.waiting.popleft().on_done(None, error)
                continue
            if self.rows or self.prefilling or self.joining:
                over_tokens = self.num_reserved_tokens + request.num_reserved_tokens > self.limits.max_batch_tokens
                over_rows = self.num_rows_in_use + request.params.n > self.limits.max_running_requests
                if over_tokens or over_rows:
                    break  # waits for running requests to finish
            shared = request.shared
            if shared is not None and shared.done is None:
                budget = self._start_shared(shared, budget, ending)
                if shared.done is None and shared.error is None:
                    break  # the head waits for its shared prefix (done by the next step)
            self.waiting.popleft()
            if shared is not None and shared.error is not None:
                request.on_done(None, shared.error)
                continue
            if request.should_stop():  # cancelled or past its deadline while waiting
                self._cancelled_before_start(request)
                continue
            try:
                context = None if shared is None else shared.context_for(request.parts, request.prompt.num_tokens
                                                                         + request.max_new_tokens)
                prefill = ChunkedPrefill(request.parts, request.prompt, request.mode,
                                         request.prompt.num_tokens + request.max_new_tokens, request.params.request_id,
                                         repair_options(request.parts, request.params), request.params.prompt_logprobs,
                                         context=context)
            except Exception as error:
                self._fail(request, error)
                continue
            item = (request, prefill)
            self.prefilling.append(item)
            budget = self._plan_piece(item, budget, ending)
        if ending:
            self._run_together(ending)
        if self.joining:
            self._place_joining()

    def _start_shared(self, shared: SharedPrefix, budget: int, ending: list) -> int:
        if shared.prefill is None and shared.error is None:
            try:
                shared.start(self.parts)
            except Exception as error:
                logger.exception("[%s] shared prefix failed", shared.request_id)
                shared.error = error
                return budget
            if shared.done is None:
                item = (shared, shared.prefill)
                self.prefilling.append(item)
                return self._plan_piece(item, budget, ending)
        return budget

    def _plan_piece(self, item: tuple[object, ChunkedPrefill], budget: int, ending: list) -> int:
        """Runs or sets aside the item's next piece; returns the budget left."""
        owner, prefill = item
        if prefill.done is not None:  # nothing had to run
            self._prefilled(item)
            return budget
        if not prefill.whole and prefill.num_remaining <= budget:
            ending.append(item)
            return budget - prefill.num_remaining
        try:
            num_run = prefill.advance(budget)
        except Exception as error:
            self._failed(item, error)
            return budget
        if prefill.done is not None:
            self._prefilled(item)
        return budget - num_run

    def _run_together(self, items: list[tuple[object, ChunkedPrefill]]) -> None:
        """Runs the set-aside prefills in forwards of about max_forward_tokens tokens; each group's requests
        pick their first token (and stream it) as soon as their forward is done."""
        group: list[tuple[object, ChunkedPrefill]] = []
        num_tokens = 0
        for item in items:
            if group and num_tokens + item[1].num_remaining > self.limits.max_forward_tokens:
                self._run_group(group)
                group, num_tokens = [], 0
            group.append(item)
            num_tokens += item[1].num_remaining
        self._run_group(group)

    def _run_group(self, items: list[tuple[object, ChunkedPrefill]]) -> None:
        try:
            finish_together([prefill for _, prefill in items], self.pad_token_id)
        except Exception as error:
            for item in items:
                self._failed(item, error)
            return
        for item in items:
            self._prefilled(item)

    def _prefilled(self, item: tuple[object, ChunkedPrefill]) -> None:
        self.prefilling.remove(item)
        owner, prefill = item
        if isinstance(owner, StreamRequest):
            self._join(owner, prefill.done)

    def _failed(self, item: tuple[object, ChunkedPrefill], error: BaseException) -> None:
        self.prefilling.remove(item)
        owner, _ = item
        if isinstance(owner, SharedPrefix):
            logger.exception("[%s] shared prefix failed", owner.request_id, exc_info=error)
            owner.error = error  # its requests fail as they reach the head of the queue
        else:
            self._fail(owner, error)

    def _join(self, request: StreamRequest, prefilled: Prefilled) -> None:
        """The request picks its first token(s); each of its n completions joins the batch as a row."""
        parts, params, prompt = request.parts, request.params, request.prompt
        if prefilled.prompt_logprobs and request.on_token is not None:
            request.on_token(TokenEvent("", (), prompt_logprobs=prefilled.prompt_logprobs))
        request.outcomes, request.num_open_rows = [None] * params.n, params.n
        length = prompt.num_tokens
        for index in range(params.n):
            # The first completion's first token sends the new chunks to the store (once per request).
            write_back = (lambda: self._write_back(request, prefilled.pending)) if index == 0 else _nothing
            decoder = RowDecoder(
                IncrementalDetokenizer(parts.tokenizer, prompt.token_ids, params.stop),
                SamplingSettings.of(params, choice=index), parts.eos_ids, request.max_new_tokens, request.on_token,
                request.should_stop, after_first_token=write_back, tokenizer=parts.tokenizer, device=parts.device,
                index=index)
            row = RunningRow(request, prefilled, decoder, index)
            row.next_token_id = int(decoder.take(prefilled.first_logits))
            row.next_position = length
            if decoder.reason:
                self._finish(row)
            else:
                self.joining.append(row)

    def _place_joining(self) -> None:
        """The rows that joined this step enter the batch together (it moves at most once for all of them)."""
        rows, self.joining = self.joining, []
        slots = self.batch.add([(row.prefilled.key_buffer[:, :, : row.next_position],
                                 row.prefilled.value_buffer[:, :, : row.next_position]) for row in rows])
        for slot, row in zip(slots, rows):
            self.rows[slot] = row
        for row in rows:  # the batch holds their K/V now; the write-back keeps its own views until stored
            row.prefilled.key_buffer = row.prefilled.value_buffer = row.prefilled.cache = None

    def _write_back(self, request: StreamRequest, pending: PendingChunks | None) -> None:
        if request.shared is None:
            submit_write_back(request.parts, pending)
            return
        for item in request.shared.pending_once(pending):
            submit_write_back(request.parts, item)

    def _fail(self, request: StreamRequest, error: BaseException) -> None:
        logger.exception("[%s] prefill failed", request.params.request_id, exc_info=error)
        request.on_done(None, error)

    def _cancelled_before_start(self, request: StreamRequest) -> None:
        outcomes = [_record(request, empty_context(), 0, cancelled_before_start(), index)
                    for index in range(request.params.n)]
        request.on_done(outcomes, None)

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
        if request.shared is None:
            context, num_cached = prefilled.context, prefilled.num_cached_tokens
        else:  # counted as the shared prefix gave it: what the store held of it
            context, num_cached = request.shared.done.context, request.shared.done.num_cached_tokens
        request.outcomes[row.index] = _record(request, context, num_cached, decoded, row.index)
        request.num_open_rows -= 1
        if request.num_open_rows == 0:
            request.on_done(request.outcomes, None)


def run_to_completion(parts: EngineParts, requests_for: Callable[[OnDone], Sequence[StreamRequest]],
                      pad_token_id: int = 0) -> list[GenerationOutcome]:
    """Runs requests on a scheduler of their own until they have ended (a call outside the service's worker:
    the engine's batch and n > 1 calls); requests_for(on_done) makes them, reporting once through on_done.

    No other request's decoding waits on these: their whole prefill runs in the first step, in one forward
    (16 rows at a time, as many as the service's default batch).

    Returns the outcomes reported; raises the error reported, or that of a failed step (which fails every request).
    """
    ended: list[tuple[list[GenerationOutcome] | None, BaseException | None]] = []
    scheduler = Scheduler(parts, SchedulerLimits(max_batch_tokens=UNBOUNDED, max_prefill_tokens=UNBOUNDED,
                                                 max_forward_tokens=UNBOUNDED), pad_token_id)
    for request in requests_for(lambda outcomes, error: ended.append((outcomes, error))):
        scheduler.submit(request)
    while scheduler.has_work():
        try:
            scheduler.step()
        except Exception as error:
            scheduler.fail_all(error)
            raise
    (outcomes, error), = ended
    if error is not None:
        raise error
    return outcomes


def _record(request: StreamRequest, context: AssembledContext, num_cached: int, decoded,
            index: int) -> GenerationOutcome:
    """Completion `index`'s outcome; the request is added to the counters once (by its first completion)."""
    params = request.params
    if index > 0:
        return outcome_of(params, request.mode, request.prompt.num_tokens, num_cached,
                          context.num_recomputed_tokens, decoded, context.degraded, index)
    label = request.label + (f" {params.n} choices" if params.n > 1 else "")
    return record_outcome(request.parts, params, request.mode, request.prompt, context, num_cached, decoded,
                          count_fetched=request.count_fetched, label=label)


def _nothing() -> None:
    pass


def _maybe_plan(parts: EngineParts, request: StreamRequest) -> None:
    if request.prompt is None:
        request.parts = for_request(parts, request.params)
        request.mode, request.prompt, request.max_new_tokens = plan_request(request.parts, request.params)
