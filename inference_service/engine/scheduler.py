"""The step planner: which requests are admitted, which prefill pieces run, which rows decode (pure: no tensors).

The engine's step loop (engine/core.py) asks `admit()` for the requests that start this step, lets the
executor look their prompts up (which says how many prompt tokens are already in place), then asks
`plan()` for the step's prefill pieces; every running row decodes one token in every step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from inference_service.kv_memory.slot_ledger import SlotLedger

# Prompt tokens per batched prefill forward. On a CPU a forward is compute-bound from about this many tokens on
# (docs/benchmarks.md, "What a step costs now"), so larger forwards save little, while every request in a forward
# waits for all of it before its first token.
FORWARD_TOKENS = 128
# The defaults by device: (prompt tokens prefilled per step, tokens per batched prefill forward). On a GPU a forward
# is launch- and bandwidth-bound far beyond a CPU's 128 tokens (an 8B model in bf16 prefills 2k tokens in about the
# time of a few hundred), so pieces are larger; a long prompt still yields to decoding rows every 8192 tokens.
DEVICE_LIMITS = {"cpu": (512, FORWARD_TOKENS), "cuda": (8192, 2048)}


def device_limits(device_type: str, max_prefill_tokens: int = 0, max_forward_tokens: int = 0) -> tuple[int, int]:
    """(max_prefill_tokens, max_forward_tokens): the given ones, or the device's defaults where they are 0."""
    prefill, forward = DEVICE_LIMITS.get(device_type, DEVICE_LIMITS["cpu"])
    return max_prefill_tokens or prefill, max_forward_tokens or forward


@dataclass(slots=True, frozen=True)
class SchedulerLimits:
    max_prefill_tokens: int = 512  # prompt tokens prefilled per step before the running rows decode again
    max_forward_tokens: int = FORWARD_TOKENS  # prompt tokens of short prefills batched in one forward
    batch_prefills: bool = True  # False: every prefill piece runs alone (models with sliding-window layers)
    # Requests admitted at once (prefilling or decoding); a request with n completions counts once, its n rows
    # are bounded by the ledger's slots. Counting requests, not rows, keeps one request with many completions
    # from holding every place while single-row requests wait behind it.
    max_running_requests: int = 16

    def __post_init__(self) -> None:
        assert self.max_prefill_tokens > 0, f"max_prefill_tokens must be positive, got {self.max_prefill_tokens}"
        assert self.max_forward_tokens > 0, f"max_forward_tokens must be positive, got {self.max_forward_tokens}"
        assert self.max_running_requests > 0, f"max_running_requests must be positive, got {self.max_running_requests}"


@dataclass(slots=True)
class RequestState:
    """What the scheduler knows of one request: counts, never tensors."""

    seq_id: int
    num_prompt_tokens: int
    num_reserved_tokens: int  # per row: prompt + max_new_tokens
    num_rows: int = 1  # a request with n completions decodes as n rows
    num_computed: int | None = None  # prompt tokens whose K/V are in place; None until its prompt is looked up
    whole: bool = False  # its prefill runs in one piece (repair of content hits, every prompt token's logprob)
    slots: list[int] = field(default_factory=list)

    @property
    def num_remaining(self) -> int:
        assert self.num_computed is not None, f"sequence {self.seq_id} has not been looked up yet"
        return self.num_prompt_tokens - self.num_computed


@dataclass(slots=True, frozen=True)
class StepPlan:
    """pieces: (seq id, tokens) each run in a forward of its own, in order; groups: seq ids whose whole rest runs in
    one forward per group (each then picks its first token); decode: the seq ids whose rows decode one token."""

    pieces: tuple[tuple[int, int], ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    decode: tuple[int, ...] = ()


class Scheduler:
    """First come, first admitted while fewer than max_running_requests run and the ledger has slots and bytes; a
    request that does not fit blocks the ones behind it, so a large request is never starved by small ones. In each step, prefills whose rest fits one
    forward go first (a short question is not held up by a long document), and the oldest longer prefill always
    gets a piece of at least max_forward_tokens, so it is never starved either."""

    def __init__(self, limits: SchedulerLimits, ledger: SlotLedger) -> None:
        self.limits, self.ledger = limits, ledger
        self.waiting: deque[RequestState] = deque()
        self.prefilling: list[RequestState] = []  # admitted, oldest first
        self.running: dict[int, RequestState] = {}  # seq id -> state, decoding

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running_rows(self) -> int:
        return sum(state.num_rows for state in self.running.values())

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, state: RequestState) -> None:
        assert self.ledger.fits_at_all(state.num_reserved_tokens, state.num_rows), (
            f"sequence {state.seq_id} can never fit; check fits_at_all before adding")
        self.waiting.append(state)

    def admit(self) -> list[RequestState]:
        """The waiting requests that start now, in arrival order, with their slots reserved."""
        admitted = []
        while (self.waiting and len(self.prefilling) + len(self.running) < self.limits.max_running_requests
               and self.ledger.can_admit(self.waiting[0].num_reserved_tokens, self.waiting[0].num_rows)):
            state = self.waiting.popleft()
            state.slots = self.ledger.admit(state.num_reserved_tokens, state.num_rows)
            self.prefilling.append(state)
            admitted.append(state)
        return admitted

    def plan(self) -> StepPlan:
        """This step's prefill pieces (within max_prefill_tokens, see the class) and decoding rows."""
        limits = self.limits
        ready = [state for state in self.prefilling if state.num_computed is not None and state.num_remaining > 0]
        budget = limits.max_prefill_tokens
        if not self.running and len(ready) == 1:
            budget = ready[0].num_remaining  # nobody decodes or waits on it: the lone prefill runs to its end
        short = [s for s in ready if not s.whole and s.num_remaining <= min(limits.max_forward_tokens, budget)]
        ending = []
        for state in short:
            if state.num_remaining <= budget:
                ending.append(state)
                budget -= state.num_remaining
        pieces = []
        for index, state in enumerate(s for s in ready if s not in ending):
            floor = limits.max_forward_tokens if index == 0 else 0  # the oldest always moves on
            take = state.num_remaining if state.whole else min(state.num_remaining, max(budget, floor))
            if take <= 0 or (state.whole and budget <= 0 and index > 0):
                break
            pieces.append((state.seq_id, take))
            budget -= take
        return StepPlan(tuple(pieces), self._groups(ending), tuple(self.running))

    def prefilled(self, seq_id: int) -> None:
        """The sequence picked its first token(s): its rows decode from the next step on."""
        state = self._prefilling(seq_id)
        self.prefilling.remove(state)
        self.running[seq_id] = state

    def remove(self, seq_id: int) -> RequestState | None:
        """Forgets a sequence wherever it is (finished, failed or cancelled); its slots are the K/V owner's to free."""
        if seq_id in self.running:
            return self.running.pop(seq_id)
        for state in list(self.prefilling) + list(self.waiting):
            if state.seq_id == seq_id:
                (self.prefilling if state in self.prefilling else self.waiting).remove(state)
                return state
        return None

    def _prefilling(self, seq_id: int) -> RequestState:
        for state in self.prefilling:
            if state.seq_id == seq_id:
                return state
        raise KeyError(f"sequence {seq_id} is not prefilling")

    def _groups(self, ending: list[RequestState]) -> tuple[tuple[int, ...], ...]:
        """Short prefills in forwards of about max_forward_tokens (each alone without batch_prefills)."""
        groups: list[list[int]] = []
        num_tokens = 0
        for state in ending:
            if not groups or not self.limits.batch_prefills or num_tokens + state.num_remaining > self.limits.max_forward_tokens:
                groups.append([])
                num_tokens = 0
            groups[-1].append(state.seq_id)
            num_tokens += state.num_remaining
        return tuple(tuple(group) for group in groups)
