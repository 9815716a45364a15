"""The step loop: requests arrive from any thread; one thread admits, plans and executes, one step at a time."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable

import torch

from inference_service.engine.executor import Executor
from inference_service.kv_memory.kv_owner import KvOwner, bytes_per_token
from inference_service.engine_parts.planning import EngineParts
from inference_service.engine.scheduler import Scheduler, SchedulerLimits, RequestState
from inference_service.kv_memory.slot_ledger import SlotLayout, SlotLedger, plan_slots
from inference_service.engine.request import EngineRequest
from inference_service.engine_parts.types import MAX_CHOICES
from inference_service.errors import EngineFatal, EngineStopped, InvalidRequest, QueueFull
from inference_service.model.batch_forward import has_sliding_layers
from inference_service.model.step_runner import choose_runner

logger = logging.getLogger(__name__)

# A request whose prompt chunks this process is still writing back waits (at most this long) for them to land
# instead of recomputing them: a follow-up sent right after a long first question finds its document.
HOLD_FOR_WRITE_BACK_S = 10.0
# Requests that arrive while a step admits and places others join that step (a second round): two prompts cached to
# their last token, sent together, then share one forward instead of the second waiting a whole step.
ADMISSION_ROUNDS = 2


class EngineCore:
    """Owns the scheduler, the executor and the K/V owner, and the thread that steps them.

    step(): the requests that arrived join the queue; slots whose holders are done are freed; the scheduler
    admits what fits, the executor looks those prompts up; the scheduler plans the step's prefill pieces and
    the executor runs them and one decode step for every running row.
    """

    def __init__(self, parts: EngineParts, limits: SchedulerLimits, num_slots: int, kv_budget_bytes: int,
                 max_queue: int, pad_token_id: int = 0) -> None:
        batched = not has_sliding_layers(parts.model.config)
        if not batched or parts.config.invariant_prefill:  # invariant: every forward is one chunk of one prompt
            limits = dataclasses.replace(limits, batch_prefills=False)
        # The longest request, prompt and generated (the longest prompt still runs; a prompt of --max-prompt-tokens
        # with --max-new-tokens is what a smaller limit lets through).
        longest = min(max(parts.geometry.max_context, parts.max_prompt_tokens),
                      parts.max_prompt_tokens + parts.config.max_new_tokens_limit) + 1
        if parts.config.invariant_prefill:  # the prompt's last piece is padded to a whole one in its slot
            longest += parts.config.invariant_piece_tokens - 1
        # One slot per row: at least one per running request (limits.max_running_requests) and a request's n
        # completions (up to MAX_CHOICES); spare slots let ended rows' write-backs drain while new rows start.
        spare = max(4, num_slots // 2)
        per_token = bytes_per_token(parts.geometry, parts.dtype)
        by_budget = parts.config.kv_slots_by_budget
        self.layout = plan_slots(max(num_slots, MAX_CHOICES) + spare, longest, kv_budget_bytes, per_token,
                                 parts.device.type != "cpu" if by_budget is None else by_budget)
        log_layout(self.layout, per_token, kv_budget_bytes, max(num_slots, MAX_CHOICES) + spare, longest)
        ledger = SlotLedger(self.layout.num_slots, kv_budget_bytes, per_token)
        self.owner = KvOwner(ledger, parts.geometry, self.layout.capacity, parts.device, parts.dtype)
        self.scheduler = Scheduler(limits, self.owner.ledger)
        runner = choose_runner(parts.model, self.owner.buffers, parts.config.decode_step,  # logs what runs, and why
                               invariant=invariant_decode(parts.config, parts.device, parts.dtype))
        self.executor = Executor(parts.model, self.owner, self.scheduler, runner, batched, pad_token_id)
        self.max_queue = max_queue
        self._padded_to = parts.config.invariant_piece_tokens
        self.on_fatal: Callable[[BaseException], None] | None = None  # the process must restart (serving exits)
        self.num_steps = 0
        self._inbox: deque[EngineRequest] = deque()
        self._held: list[tuple[float, EngineRequest]] = []  # (deadline, request) waiting for a write-back of its chunks
        self._wake = threading.Condition()
        self._writeback = parts.writeback
        self._l0 = parts.l0
        self._writeback.on_settled = self._wake_up
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self._held) + self.scheduler.num_waiting

    def _wake_up(self) -> None:
        with self._wake:
            self._wake.notify()

    def has_room(self, num_requests: int) -> bool:
        """Whether submit would queue that many requests now (it checks again, under its lock)."""
        return not self._stopping and self.num_waiting + num_requests <= self.max_queue

    def submit(self, seqs: Iterable[EngineRequest]) -> None:
        """Queues the requests (all or none); callable from any thread.

        Raises:
            InvalidRequest: a request needs more K/V than the whole budget.
            QueueFull: max_queue requests are already waiting.
            EngineStopped: the engine is shutting down.
        """
        seqs = list(seqs)
        ledger = self.owner.ledger
        for seq in seqs:
            seq.state = RequestState(seq.seq_id, seq.prompt.num_tokens, seq.prompt.num_tokens + seq.max_new_tokens,
                                      num_rows=seq.num_rows)
            padded = -(-seq.prompt.num_tokens // self._padded_to) * self._padded_to  # invariant prefill's last piece
            if max(seq.prompt.num_tokens + seq.max_new_tokens, padded) > self.owner.capacity or not ledger.fits_at_all(
                    seq.state.num_reserved_tokens, seq.state.num_rows):
                need = ledger.bytes_for(seq.state.num_reserved_tokens, seq.state.num_rows)
                raise InvalidRequest(
                    f"the request needs {need} bytes of K/V ({seq.state.num_reserved_tokens} tokens x "
                    f"{seq.state.num_rows} rows; a slot holds {self.owner.capacity} tokens"
                    + (f", the prompt padded to {padded} by invariant prefill" if padded > seq.prompt.num_tokens else "")
                    + f") and the budget is "
                    f"{ledger.budget_bytes}: lower max_tokens or n, or start the service with a larger --kv-cache-bytes")
        with self._wake:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if self.num_waiting + len(seqs) > self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting for the model; retry later or start "
                                "the service with a larger --max-queue")
            self._inbox.extend(seqs)
            self._wake.notify()

    def start(self, first: Callable[[], None] | None = None) -> None:
        """Starts the step loop; first: run on the loop's thread before any request (start-up work that must
        happen there: the pinned staging ring is the thread's)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, args=(first,), name="engine-step-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Requests still waiting fail with EngineStopped; running ones finish; then the loop ends."""
        with self._wake:
            self._stopping = True
            waiting, self._inbox = list(self._inbox) + [seq for _, seq in self._held], deque()
            self._held = []
            self._wake.notify()
        stopped = EngineStopped("the service shut down before this request started")
        for seq in waiting:
            seq.end(None, stopped)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    def _release_held(self, arrived: list[EngineRequest]) -> list[EngineRequest]:
        """The arrivals and held requests that may start: those none of whose prompt chunks is being written
        back by this process, or that waited HOLD_FOR_WRITE_BACK_S for it. The rest are held (FIFO kept)."""
        now = time.monotonic()
        candidates = self._held + [(now + HOLD_FOR_WRITE_BACK_S, seq) for seq in arrived]
        ready: list[EngineRequest] = []
        held: list[tuple[float, EngineRequest]] = []
        for deadline, seq in candidates:
            keys = [*seq.prompt.prefix_keys, *([seq.prompt.tail_key] if seq.prompt.tail_key else [])]
            if seq.mode != "baseline" and now < deadline and self._writeback.storing(keys):
                seq.early_lookup = None  # asked before the write-back it waits for landed: asked again when it starts
                held.append((deadline, seq))
            else:
                ready.append(seq)
        self._held = held
        return ready

    @torch.inference_mode()
    def step(self) -> None:
        for round_ in range(ADMISSION_ROUNDS):
            with self._wake:
                arrived, self._inbox = list(self._inbox), deque()
            if round_ and not arrived:
                break
            for seq in self._release_held(arrived):
                self.executor.sequences[seq.seq_id] = seq
                self.scheduler.add(seq.state)
            self.owner.collect()
            for state in self.scheduler.admit():
                self.executor.start(self.executor.sequences[state.seq_id])
        self.executor.run(self.scheduler.plan())
        self.num_steps += 1

    def stats(self) -> dict:
        return {"running_rows": self.scheduler.num_running_rows, "waiting_requests": self.num_waiting,
                **self.owner.stats(), "decode_step": self.executor.runner.name,
                **(self._l0.snapshot() if self._l0 is not None else {})}

    def _loop(self, first: Callable[[], None] | None = None) -> None:
        if first is not None:
            first()
        while True:
            with self._wake:
                while not self._stopping and not self.has_work():
                    if self._held:  # released by a write-back ending (it wakes us) or by its deadline
                        self._wake.wait(timeout=0.05)
                        break
                    self._wake.wait()
                if self._stopping and not self.scheduler.has_work() and not self._inbox:
                    return
            try:
                self.step()
            except EngineFatal as error:
                logger.critical("%s: failing every request", error)
                self.executor.fail_all(error)
                if self.on_fatal is not None:
                    self.on_fatal(error)
                return
            except Exception as error:  # outside every request's own work: each request ends with it
                logger.exception("engine step failed; its requests fail")
                self.executor.fail_all(error)


def log_layout(layout: SlotLayout, per_token: int, budget_bytes: int, wanted_slots: int, longest: int) -> None:
    """Says at start-up what the K/V slots reserve, and what limits the budget put on them."""
    gib = layout.memory_bytes(per_token) / 2**30
    if not layout.by_budget:
        logger.info("K/V: %d slots x %d tokens (%.2f GiB of address space, committed only as written; running "
                    "requests reserve at most --kv-cache-bytes %d)", layout.num_slots, layout.capacity, gib,
                    budget_bytes)
        return
    logger.info("K/V: %d slots x %d tokens reserved on the device, %.2f GiB within --kv-cache-bytes %d",
                layout.num_slots, layout.capacity, gib, budget_bytes)
    if layout.num_slots < wanted_slots or layout.capacity < longest:
        logger.warning("K/V: the budget holds %d of the %d slots wanted, of %d of %d tokens: fewer requests run at "
                       "once, and longer ones are refused; raise --kv-cache-bytes or lower --max-prompt-tokens and "
                       "--max-new-tokens", layout.num_slots, wanted_slots, layout.capacity, longest)


def invariant_decode(config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode steps run the invariant step: as asked, or (None) with invariant prefill on CUDA in half
    precision."""
    if config.invariant_decode is not None:
        return config.invariant_decode
    return config.invariant_prefill and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
