"""Runs the scheduler's decisions on the model: lookups, prefill pieces, first tokens, one decode step.

Each request's own work runs inside that request's guard: an exception there ends that request alone (its
status from the error: INVALID_ARGUMENT where its parameters caused it, INTERNAL otherwise) and frees its
slots; the others go on. Only a failure of a forward that several requests share ends each of them, each
through its own on_done.
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Callable

import torch

from inference_service.engine import prefill
from inference_service.engine_parts.generation import RowDecoder, SamplingSettings, step_hints, takes_hint
from inference_service.engine_parts.planning import answer_chunks
from inference_service.engine.request import Row, EngineRequest
from inference_service.engine_parts.types import TokenEvent
from inference_service.reuse.assembler import AssembledContext
from inference_service.errors import EngineError, EngineFatal, is_device_fatal
from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.model.batch_forward import BatchWorkspace
from inference_service.model.forward import decode_alone
from inference_service.kv_memory.kv_buffers import build_cache

if TYPE_CHECKING:  # annotations only: the core builds both and hands them in
    from inference_service.kv_memory.kv_owner import KvOwner
    from inference_service.engine.scheduler import Scheduler, StepPlan
    from inference_service.model.step_runner import StepRunner

logger = logging.getLogger(__name__)


class Executor:
    """The only part of the engine that runs forwards; every sequence it knows is in `sequences` by seq id."""

    def __init__(self, model, owner: KvOwner, scheduler: Scheduler, runner: StepRunner, batched: bool,
                 pad_token_id: int = 0) -> None:
        """runner: the batched decode step over the owner's slots (model.step_runner.choose_runner)."""
        self.model, self.owner, self.scheduler, self.runner = model, owner, scheduler, runner
        self.batched = batched  # False: rows decode one at a time, each in its own cache (sliding-window models)
        self.pad_token_id = pad_token_id
        self.workspace = BatchWorkspace.for_device(model.device)  # batched prefills' buffers, kept on a CPU
        self.sequences: dict[int, EngineRequest] = {}

    # ---- admission and prefill --------------------------------------------------------------------

    def start(self, seq: EngineRequest) -> None:
        """An admitted sequence: holds its slots and places what the store has (a follower waits for its source)."""
        for slot in seq.state.slots:
            self.owner.hold(slot)
        seq.held_slots = set(seq.state.slots)
        if seq.should_stop():  # cancelled or past its deadline while waiting
            self._guard(seq, seq.cancelled_before_start)
            self._fail(seq, None)
            return
        if seq.source is not None and not seq.source.ended and seq.source.first_logits is None:
            return  # placed when its source's prefill is done (_hand_over)
        self._guard(seq, lambda: self._place(seq))

    def run(self, plan: StepPlan) -> None:
        """One step: the plan's prefill pieces, its groups of short prefills, then one token for every running row."""
        for seq_id, num_tokens in plan.pieces:
            seq = self.sequences.get(seq_id)
            if seq is not None:
                self._guard(seq, lambda seq=seq, num_tokens=num_tokens: self._run_piece(seq, num_tokens))
        starting: list[EngineRequest] = []  # prompts cached to their last token: it runs in the decode forward
        for group in plan.groups:
            seqs = [self.sequences[seq_id] for seq_id in group if seq_id in self.sequences]
            if self.batched:
                starting += [seq for seq in seqs if prefill.runs_in_decode_step(seq)]
                seqs = [seq for seq in seqs if seq not in starting]
            self._run_group(seqs)
        decoding = [self.sequences[seq_id] for seq_id in plan.decode if seq_id in self.sequences]
        if decoding or starting:
            self._decode(decoding, starting)

    def _place(self, seq: EngineRequest) -> None:
        source = seq.source
        # An approximate source's K/V is never shared: the follower looks its prompt up itself (and stays exact).
        if (source is not None and source.first_logits is not None and not source.approximate
                and source.state.slots[0] in source.held_slots):
            self.owner.buffers.copy_prefix(seq.source.state.slots[0], seq.state.slots[0], seq.num_shared_tokens)
            seq.context = AssembledContext(None, None, seq.num_shared_tokens, seq.num_shared_chunks,  # and its epoch
                                           degraded=source.context.degraded, delete_epoch=source.context.delete_epoch)
            prefill.place(seq, self.owner.views(seq.state.slots[0]), seq.num_shared_tokens)
        else:
            seq.source = None  # its source failed or shares nothing: it looks its prompt up itself
            prefill.start(seq, self.owner.views(seq.state.slots[0]))
        self._maybe_prefilled(seq)

    def _run_piece(self, seq: EngineRequest, num_tokens: int) -> None:
        prefill.run_piece(seq, self.owner.views(seq.state.slots[0]), num_tokens)
        self._maybe_prefilled(seq)

    def _run_group(self, seqs: list[EngineRequest]) -> None:
        if not seqs:
            return
        try:  # one forward for all of them: its failure is each one's
            prefill.run_together(seqs, [self.owner.views(seq.state.slots[0]) for seq in seqs], self.pad_token_id,
                                 self.workspace)
        except Exception as error:
            for seq in seqs:
                self._fail(seq, error)
            return
        for seq in seqs:
            self._guard(seq, lambda seq=seq: self._maybe_prefilled(seq))

    def _maybe_prefilled(self, seq: EngineRequest, hint: tuple[bool, int] | None = None) -> None:
        """After the last prompt token: the followers take the shared K/V, then the sequence picks its first token
        (hint: its first logits' step_hints, when the step that computed them took them already)."""
        if seq.state.num_computed < seq.prompt.num_tokens or seq.ended:
            return
        self.owner.buffers.written(seq.state.slots[0], seq.prompt.num_tokens)
        self._hand_over(seq)
        if seq.warm is not None:
            self._store_warm(seq)
            return
        self.scheduler.prefilled(seq.seq_id)
        self._join(seq, hint)

    def _hand_over(self, source: EngineRequest) -> None:
        for follower in source.followers:
            if follower.seq_id in self.sequences and follower.state.slots and follower.state.num_computed is None:
                self._guard(follower, lambda follower=follower: self._place(follower))
        source.followers = []

    # ---- the first token and decoding ----------------------------------------------------------------

    def _join(self, seq: EngineRequest, hint: tuple[bool, int] | None = None) -> None:
        """The sequence picks its first token(s); each of its n completions decodes as a row in its own slot."""
        parts, params, prompt = seq.parts, seq.params, seq.prompt
        if seq.prompt_logprobs and seq.on_token is not None:
            seq.on_token(TokenEvent("", (), prompt_logprobs=seq.prompt_logprobs))
        seq.outcomes = [None] * params.n
        first_slot = seq.state.slots[0]
        for index, slot in enumerate(seq.state.slots):
            if index:
                self.owner.buffers.copy_prefix(first_slot, slot, prompt.num_tokens)
            decoder = RowDecoder(
                IncrementalDetokenizer(parts.tokenizer, prompt.token_ids, params.stop),
                SamplingSettings.of(params, choice=index), parts.eos_ids, seq.max_new_tokens, seq.on_token,
                seq.should_stop, after_first_token=(lambda: self._write_back(seq)) if index == 0 else (lambda: None),
                tokenizer=parts.tokenizer, device=parts.device, index=index,
                approximate_tokens=seq.context.num_approximate_tokens if seq.approximate else None)
            cache = None
            if not self.batched:
                cache = seq.cache if index == 0 else build_cache(parts.model.config, *self.owner.views(slot),
                                                                  prompt.num_tokens)
            seq.rows.append(Row(slot, index, decoder, next_position=prompt.num_tokens, cache=cache))
        # One device -> host copy for the first token (its NaN check and greedy choice), as for a decode step's; a
        # sampled first token (or one whose EOS is held off) reads the logits itself, so nothing is computed for it.
        hint = (hint or step_hints(seq.first_logits.view(1, -1))[0]) if takes_hint(params) else None
        for row in list(seq.rows):
            row.next_token_id = int(row.decoder.take(seq.first_logits, hint))
            if row.decoder.reason:
                self._finish_row(seq, row)

    def _decode(self, seqs: list[EngineRequest], starting: list[EngineRequest] = ()) -> None:
        """A token for every row of `seqs`; in the same forward each of `starting` runs its last prompt token."""
        rows = [(seq, row) for seq in seqs for row in seq.rows]
        try:  # one forward for every row: its failure is each request's
            logits = self._forward_rows(rows, starting)
        except Exception as error:
            for seq in [*seqs, *starting]:
                self._fail(seq, error)
            return
        # One check for every row and first token: a row whose logits are NaN or +inf fails alone (in its guard).
        hints = step_hints(torch.stack(logits) if isinstance(logits, list) else logits)  # one device -> host copy
        for (seq, row), row_logits, hint in zip(rows, logits, hints):
            self._guard(seq, lambda seq=seq, row=row, row_logits=row_logits, hint=hint:
                        self._take(seq, row, row_logits, hint))
        for seq, first_logits, hint in zip(starting, logits[len(rows):], hints[len(rows):]):
            self._guard(seq, functools.partial(self._prefilled_in_step, seq, first_logits, hint))

    def _prefilled_in_step(self, seq: EngineRequest, first_logits: torch.Tensor, hint: tuple[bool, int]) -> None:
        prefill.finish(seq, self.owner.views(seq.state.slots[0]), first_logits.clone())  # graphs reuse their output
        self._maybe_prefilled(seq, hint)

    @torch.inference_mode()
    def _forward_rows(self, rows: list[tuple[EngineRequest, Row]],
                      starting: list[EngineRequest] = ()) -> torch.Tensor | list[torch.Tensor]:
        if self.batched:
            buffers = self.owner.buffers
            for _, row in rows:
                buffers.finite_until[row.slot] = max(buffers.finite_until[row.slot], row.next_position)
            step = {row.slot: (row.next_token_id, row.next_position) for _, row in rows}
            for seq in starting:  # its prompt but the last token is in place (placed, copied or prefilled)
                last = seq.prompt.num_tokens - 1
                buffers.written(seq.state.slots[0], last)
                step[seq.state.slots[0]] = (seq.prompt.token_ids[last], last)
            return self.runner.decode(step)
        return [decode_alone(self.model, row.cache, torch.tensor(row.next_token_id, device=self.model.device),
                             row.next_position) for _, row in rows]

    def _take(self, seq: EngineRequest, row: Row, logits: torch.Tensor, hint: tuple[bool, int] | None = None) -> None:
        if seq.ended:  # another of its rows failed this step
            return
        row.next_position += 1
        row.next_token_id = int(row.decoder.take(logits, hint))
        if row.decoder.reason:
            self._finish_row(seq, row)

    def _finish_row(self, seq: EngineRequest, row: Row) -> None:
        decoded = row.decoder.finish()
        if row.index == 0:  # submitted before the request reports its end
            self._store_answer(seq, row)
        ended = seq.finish_row(row, decoded)
        seq.held_slots.discard(row.slot)
        self.owner.end_row(row.slot)
        if ended:
            self._forget(seq)

    # ---- write-back, failures --------------------------------------------------------------------------

    def _write_back(self, seq: EngineRequest) -> None:
        self._keep_fetched(seq)
        pending = seq.pending
        if pending is not None and seq.stored_keys is not None:  # a batch call: no chunk is stored twice
            pending = pending.without(seq.stored_keys)
        if pending is None:
            return
        slot = seq.state.slots[0]
        self.owner.hold(slot)  # the write-back reads the slot's K/V on its own thread
        seq.parts.writeback.submit(pending, lambda stored, error: self.owner.let_go(slot))

    def _keep_fetched(self, seq: EngineRequest) -> None:
        """L0 copies the whole chunks this prompt took from the store, on the write-back thread (after the first
        token: never on the request's path)."""
        spans = seq.context.fetched_whole
        if not spans or (seq.parts.l0 is None and seq.parts.host is None):
            return
        slot = seq.state.slots[0]
        self.owner.hold(slot)  # the copy reads the slot's K/V on its own thread
        seq.parts.writeback.submit_fetched(self.owner.views(slot), spans, lambda: self.owner.let_go(slot))

    def _store_answer(self, seq: EngineRequest, row: Row) -> None:
        """The prompt's tail and the answer's K/V (first completion only) as chunks, so the next turn of a
        conversation reuses the whole previous turn; only K/V that are exact (every decode step is bitwise the
        model's forward: the start-up probe checks it), of single-segment prompts. Not with invariant prefill: an
        answer's K/V come from decode steps, not from whole-chunk forwards, so they would not be the uncached ones."""
        limit = 0 if seq.parts.config.invariant_prefill else seq.parts.config.max_answer_tokens_stored
        answer = row.decoder.token_ids[:-1][:limit]  # the last token was never fed back: it has no K/V
        if (not answer or not self.batched or seq.approximate or seq.mode == "baseline"
                or seq.context.degraded or seq.params.segments):
            return
        pending = answer_chunks(seq.prompt, answer, seq.parts.config.chunk_size, self.owner.views(row.slot),
                                seq.request_id, seq.context.delete_epoch)
        if pending is None:
            return
        self.owner.hold(row.slot)  # the write-back reads the slot's K/V on its own thread
        seq.parts.writeback.submit(pending, lambda stored, error: self.owner.let_go(row.slot))

    def _store_warm(self, seq: EngineRequest) -> None:
        slot = seq.state.slots[0]
        seq.held_slots.discard(slot)
        self.owner.hold(slot)  # let go of by the write-back, once it has read the slot
        self.owner.end_row(slot)
        self._forget(seq)

        def stored(count: int, error: BaseException | None) -> None:
            seq.end(None if error else seq.warm_outcome(count), error)
            self.owner.let_go(slot)

        if seq.pending is None:
            stored(0, None)
        else:
            seq.parts.writeback.submit(seq.pending, stored)

    def _guard(self, seq: EngineRequest, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as error:
            self._fail(seq, error)

    def _fail(self, seq: EngineRequest, error: BaseException | None) -> None:
        """Ends the sequence alone with `error` (None: it already reported) and frees its slots; its followers
        then look their prompts up themselves. A dead device ends the process instead."""
        if error is not None:
            if is_device_fatal(error):
                raise EngineFatal(f"the device failed: {error}") from error
            logger.error("[%s] request failed: %s: %s", seq.request_id, type(error).__name__, error,
                         exc_info=not isinstance(error, EngineError))
            seq.end(None, error)
        for slot in seq.held_slots:
            self.owner.end_row(slot)
        seq.held_slots, seq.rows = set(), []
        self._forget(seq)
        self._hand_over(seq)

    def _forget(self, seq: EngineRequest) -> None:
        self.sequences.pop(seq.seq_id, None)
        self.scheduler.remove(seq.seq_id)

    def fail_all(self, error: BaseException) -> None:
        """Ends every sequence with `error` (after a failure outside any request's work)."""
        for seq in list(self.sequences.values()):
            self._fail(seq, error)
