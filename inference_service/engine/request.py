"""One request as the engine runs it: its plan, its slots, its prefill progress, its rows, and how it ends."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from inference_service.reuse.assembler import AssembledContext, LookupFailed, early_lookup, empty_context
from inference_service.store.protocol import StoreLookup
from inference_service.engine_parts.generation import DecodeResult, OnToken, RowDecoder
from inference_service.engine_parts.planning import EngineParts, label_repair, outcome_of, record_outcome
from kvboost_keys.prompts import PromptPlan
from inference_service.engine_parts.types import GenerationOutcome, GenerationParams, TokenLogprob, WarmOutcome
from inference_service.reuse.settled_writes import still_current
from inference_service.reuse.writeback import PendingChunks
from inference_service.errors import RequestCancelled

# on_done(result, error): once per request. result: the n outcomes in index order (a generation), a WarmOutcome
# (a warm-up), or None with the error.
OnDone = Callable[[object, BaseException | None], None]
ShouldStop = Callable[[], bool]

if TYPE_CHECKING:  # for annotations only: the core gives each sequence its state when it is submitted
    from inference_service.engine.scheduler import RequestState

_ids = itertools.count(1)


@dataclass(slots=True)
class WarmSpec:
    """A warm-up: every chunk computed (nothing looked up) and stored; no token is generated."""

    content_addressed: bool = False
    pin: bool = False


@dataclass(slots=True)
class Row:
    """One completion decoding in a slot."""

    slot: int
    index: int  # which of the request's completions
    decoder: RowDecoder
    next_token_id: int = 0
    next_position: int = 0
    cache: object = None  # its own DynamicCache when rows decode one at a time (sliding-window models)


@dataclass(slots=True, eq=False)
class EngineRequest:
    """The engine's record of one request from submission to on_done."""

    params: GenerationParams
    on_token: OnToken | None
    should_stop: ShouldStop
    on_done: OnDone
    parts: EngineParts
    mode: str
    prompt: PromptPlan
    max_new_tokens: int
    warm: WarmSpec | None = None
    keep_first_logits: bool = False  # VerifyCorrectness compares the logits of the first token
    count_fetched: bool = True  # False: its shared chunks' fetch is counted on another request of its call
    label: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    state: RequestState | None = None
    # Set while prefilling.
    context: AssembledContext = field(default_factory=empty_context)
    num_cached: int = 0  # leading prompt tokens whose K/V came from the store
    whole: bool = False
    cache: object = None  # DynamicCache over the first slot's buffers
    first_logits: torch.Tensor | None = None  # [vocab]
    pending: PendingChunks | None = None  # new chunks to store after the first token
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # A batch call's shared leading chunks: `source` prefills them, its `followers` copy them from its slot.
    source: EngineRequest | None = None
    num_shared_tokens: int = 0
    num_shared_chunks: int = 0
    followers: list = field(default_factory=list)
    stored_keys: set | None = None  # a batch call's chunk keys already submitted for write-back (shared)
    # The prompt's Lookup, asked on the submitting thread (reuse.assembler.early_lookup); None: the step loop asks.
    early_lookup: StoreLookup | LookupFailed | None = None
    early_lookup_settled: int = 0  # write-backs ended when it was asked (WriteBack.settled.num_settled)
    early_lookup_seconds: float = 0.0  # how long it took (counted in the load time when its answer is used)
    # Set while decoding.
    rows: list[Row] = field(default_factory=list)
    held_slots: set = field(default_factory=set)  # slots this request still holds (its rows', or its prefill's)
    outcomes: list = field(default_factory=list)
    ended: bool = False

    def ask_early(self) -> EngineRequest:
        """Asks the prompt's Lookup now, on the submitting thread, when its prefill will look the prompt up: the step
        loop then does not wait for the daemon's answer."""
        if self.mode != "baseline" and self.params.prompt_logprobs is None and self.warm is None:
            self.early_lookup_settled = self.parts.writeback.settled.num_settled
            asked = time.perf_counter()
            self.early_lookup = early_lookup(self.parts.store, self.parts.namespace, self.prompt,
                                             self.mode == "chunk_kv_reuse")
            self.early_lookup_seconds = time.perf_counter() - asked
        return self

    def current_lookup(self) -> StoreLookup | LookupFailed | None:
        """The early Lookup unless a write-back that ended since it was asked may have stored what it missed: one of
        the prompt's chunks after the run it found, a content hit it asked for, or a partial chunk or continuation
        after the run (reuse.settled_writes.overtakes). None: the step loop asks again."""
        early = self.early_lookup
        if isinstance(early, StoreLookup) and not still_current(
                self.parts.writeback.settled, self.early_lookup_settled, self.prompt, early,
                self.mode == "chunk_kv_reuse"):
            return None
        return early

    @property
    def num_rows(self) -> int:
        """Slots it decodes in: its n completions (a warm-up prefills in one)."""
        return 1 if self.warm is not None else self.params.n

    @property
    def approximate(self) -> bool:
        """Its prompt reused content hits: later K/V attended to approximate ones (never stored)."""
        return self.context.approximate

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def need_logits(self) -> bool:
        return self.warm is None

    def end(self, result: object, error: BaseException | None) -> None:
        """Reports once; later calls do nothing."""
        if not self.ended:
            self.ended = True
            self.on_done(result, error)

    def finish_row(self, row: Row, decoded: DecodeResult) -> bool:
        """Records the row's outcome; returns True when it was the request's last open row (the request ended)."""
        self.outcomes[row.index] = self._record(decoded, row.index)
        self.rows.remove(row)
        if not self.rows:
            self.end(self.outcomes, None)
            return True
        return False

    def cancelled_before_start(self) -> None:
        if self.warm is not None:
            self.end(None, RequestCancelled("the warm-up was cancelled, or its deadline passed, before it started"))
            return
        empty = DecodeResult([], "", "cancelled", 0.0, 0.0)
        self.outcomes = [None] * self.params.n
        for index in range(self.params.n):
            self.outcomes[index] = self._record(empty, index)
        self.end(self.outcomes, None)

    def warm_outcome(self, num_stored: int) -> WarmOutcome:
        prompt = self.prompt
        num_tail = len(prompt.chunks.tail)
        note = "" if num_tail == 0 else (
            f"the last {num_tail} tokens are stored as a partial chunk: a prompt reuses them when it continues "
            f"this text token for token (where its tokenization differs at the join, only the "
            f"{prompt.num_tokens - num_tail} tokens of whole chunks are reused)")
        return WarmOutcome(num_stored, prompt.num_tokens, self.parts.config.chunk_size, num_tail == 0, num_tail, note)

    def _record(self, decoded: DecodeResult, index: int) -> GenerationOutcome:
        """Completion `index`'s outcome; the request is added to the counters once (by its first completion)."""
        context, num_cached = self.context, self.num_cached
        if self.source is not None:  # counted as the shared prefix gave it: what the store held of it
            num_cached = min(self.source.num_cached, self.num_shared_tokens)
        if index > 0:
            outcome = outcome_of(self.params, self.mode, self.prompt.num_tokens, num_cached,
                                 context.num_recomputed_tokens, decoded, context.degraded, index)
            label_repair(outcome, context)
            return outcome
        label = self.label + (f" {self.params.n} choices" if self.params.n > 1 else "")
        return record_outcome(self.parts, self.params, self.mode, self.prompt, context, num_cached, decoded,
                              count_fetched=self.count_fetched, label=label)
