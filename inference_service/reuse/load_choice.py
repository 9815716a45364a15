"""Per request: load a cached run, recompute it, or load a prefix of it, whichever is predicted faster (pure)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from inference_service.kv_memory.tier_rates import CostMeter, CostModel

DEFAULT_PROBE_INTERVAL_S = 30.0


@dataclass(slots=True, frozen=True)
class RunPart:
    """Consecutive leading tokens of a prompt's cached run that one tier would place."""

    tier: str
    num_tokens: int

    def __post_init__(self) -> None:
        assert self.num_tokens > 0, f"a run part holds tokens, got {self.num_tokens}"


@dataclass(slots=True, frozen=True)
class LoadChoice:
    """The run's leading num_parts parts are loaded (num_tokens tokens), the rest prefilled with the question."""

    num_parts: int
    num_tokens: int
    predicted_s: float  # the chosen way, to the first token's logits
    recompute_s: float  # nothing loaded; inf: the prefill is not measured
    probe: tuple[str, ...] = ()  # tiers loaded although predicted slower: to measure them again


def predicted_seconds(parts: Sequence[RunPart], num_loaded: int, question_tokens: int, bytes_per_token: int,
                      loads: Mapping[str, CostModel | None], prefill: CostModel) -> float:
    """Loading the first num_loaded parts (each tier's fixed cost once) then prefilling the rest and the question.
    A tier with no model costs nothing: it is tried, and measured."""
    seconds = prefill.seconds(sum(part.num_tokens for part in parts[num_loaded:]) + question_tokens)
    tokens_by_tier: dict[str, int] = {}
    for part in parts[:num_loaded]:
        tokens_by_tier[part.tier] = tokens_by_tier.get(part.tier, 0) + part.num_tokens
    for tier, tokens in tokens_by_tier.items():
        model = loads.get(tier)
        seconds += model.seconds(tokens * bytes_per_token) if model is not None else 0.0
    return seconds


def best_load(parts: Sequence[RunPart], question_tokens: int, bytes_per_token: int,
              loads: Mapping[str, CostModel | None], prefill: CostModel | None) -> LoadChoice:
    """The prefix of the run (whole parts) whose load and prefill are predicted fastest; a tie loads more (it spares
    the device's compute for the other requests). An unmeasured prefill loads the whole run."""
    num_tokens = sum(part.num_tokens for part in parts)
    if prefill is None:
        return LoadChoice(len(parts), num_tokens, 0.0, float("inf"))
    times = [predicted_seconds(parts, count, question_tokens, bytes_per_token, loads, prefill)
             for count in range(len(parts) + 1)]
    best = min(range(len(times)), key=lambda count: (times[count], -count))
    return LoadChoice(best, sum(part.num_tokens for part in parts[:best]), times[best], times[0])


class LoadChooser:
    """The service's cost models (prefill per token, each tier's load per byte, all with a fixed cost), seeded at
    start-up on the served model's shapes and refitted by every request's measurements; choose() answers per request.

    A tier predicted slower gets no samples, so a measurement taken in a slow moment would stick: a skipped tier
    whose last sample (or probe) is older than probe_interval_s is loaded once anyway (a probe) and measured again.
    Thread-safe.
    """

    def __init__(self, probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S, keep: float = 0.8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert probe_interval_s > 0, f"probe_interval_s must be positive, got {probe_interval_s}"
        self.probe_interval_s = probe_interval_s
        self._keep = keep
        self._clock = clock
        self.prefill = CostMeter(keep, clock)  # tokens -> seconds
        self._loads: dict[str, CostMeter] = {}  # tier -> bytes -> seconds
        self._probed_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def load_meter(self, tier: str) -> CostMeter:
        with self._lock:
            meter = self._loads.get(tier)
            if meter is None:
                meter = self._loads[tier] = CostMeter(self._keep, self._clock)
            return meter

    def models(self) -> dict[str, CostModel | None]:
        """Each tier's load model, and the prefill's under "prefill" (for logs and benchmarks)."""
        with self._lock:
            meters = dict(self._loads)
        return {"prefill": self.prefill.model, **{tier: meter.model for tier, meter in sorted(meters.items())}}

    def choose(self, parts: Sequence[RunPart], question_tokens: int, bytes_per_token: int) -> LoadChoice:
        """What to load of a run whose parts would come from these tiers, in order, before question_tokens more."""
        if not parts:
            return LoadChoice(0, 0, 0.0, 0.0)
        loads = {part.tier: self.load_meter(part.tier).model for part in parts}
        choice = best_load(parts, question_tokens, bytes_per_token, loads, self.prefill.model)
        skipped = {part.tier for part in parts[choice.num_parts:]}
        due = tuple(sorted(tier for tier in skipped if self._probe_due(tier)))
        if not due:
            return choice
        now = self._clock()
        with self._lock:
            for tier in due:
                self._probed_at[tier] = now
        prefill = self.prefill.model
        assert prefill is not None, "a part was skipped, so the prefill is measured"
        predicted = predicted_seconds(parts, len(parts), question_tokens, bytes_per_token, loads, prefill)
        return LoadChoice(len(parts), sum(part.num_tokens for part in parts), predicted, choice.recompute_s, due)

    def _probe_due(self, tier: str) -> bool:
        meter = self.load_meter(tier)
        with self._lock:
            last = max(meter.last_sample_at or float("-inf"), self._probed_at.get(tier, float("-inf")))
        if last == float("-inf"):  # seeded only: the seed is the measurement; the first probe waits an interval
            with self._lock:
                last = self._probed_at.setdefault(tier, self._clock())
        return self._clock() - last >= self.probe_interval_s
