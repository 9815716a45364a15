"""Thread-safe engine counters, reported under ServiceStatsReply field names."""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

from collections.abc import Sequence

from inference_service.reuse.load_choice import LoadChoice, LoadChooser, RunPart
from inference_service.kv_memory.tier_rates import TierLoad, loaded_seconds


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # whole chunks and partial chunks
    partial_cached_tokens: int = 0  # of cached_tokens, those from a stored partial chunk
    recomputed_tokens: int = 0  # of cached_tokens, those whose K/V repair recomputed
    computed_tokens: int = 0  # prompt tokens prefilled (not cached)
    guard_checks: int = 0  # requests whose content hits cacheblend's risk was measured for
    guard_fallbacks: int = 0  # of those, the ones the fidelity guard recomputed in full
    approximate_answers: int = 0  # requests that reused content hits (their answers say approximate)
    approximate_tokens: int = 0  # their prompt tokens whose K/V came from content hits, not recomputed
    load_bytes: int = 0  # K/V bytes placed from the cache (L0 and the daemon) into requests' slots
    load_seconds: float = 0.0  # time from each request's Lookup to its last chunk in place
    chunks_fetched: int = 0
    chunks_stored: int = 0
    bytes_fetched: int = 0
    bytes_stored: int = 0
    loads_skipped: int = 0  # requests that recomputed cached tokens because their tier loads slower (choose_load)
    load_skipped_tokens: int = 0  # those tokens
    load_probes: int = 0  # requests that loaded a tier predicted slower, to measure it again
    requests_with_first_token: int = 0
    total_ttft_ms: float = 0.0
    step_loop_lookups: int = 0  # Lookups the step loop asked (the early one missing or out of date, or a second)


@dataclass(slots=True)
class TierCounters:
    """What one tier (l0, daemon_map, daemon_fetch, store) placed into requests' slots."""

    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # host seconds from the tier's first read to its last copy issued (not to completion)
    loads: int = 0  # requests it placed chunks for


class EngineStats:
    def __init__(self) -> None:
        self._counters = _Counters()
        self._tiers: dict[str, TierCounters] = {}
        # The load-or-recompute choice's cost models: each tier's load (bytes, to the copies' completion) and the
        # prefill (prompt tokens to the first token of requests that reused nothing), seeded at start-up.
        self.chooser = LoadChooser()
        self._copies_running: list[TierLoad] = []  # CUDA loads whose copies had not completed when reported
        self._lock = threading.Lock()

    def add_request(self, prompt_tokens: int, cached_tokens: int, recomputed_tokens: int,
                    chunks_fetched: int, bytes_fetched: int, ttft_ms: float | None, partial_cached_tokens: int = 0,
                    approximate_tokens: int | None = None) -> None:
        """approximate_tokens: None for an exact answer; else its content-hit tokens kept (maybe 0)."""
        with self._lock:
            counters = self._counters
            counters.requests += 1
            counters.prompt_tokens += prompt_tokens
            counters.cached_tokens += cached_tokens
            counters.partial_cached_tokens += partial_cached_tokens
            counters.recomputed_tokens += recomputed_tokens
            counters.computed_tokens += prompt_tokens - cached_tokens
            counters.chunks_fetched += chunks_fetched
            counters.bytes_fetched += bytes_fetched
            if approximate_tokens is not None:
                counters.approximate_answers += 1
                counters.approximate_tokens += approximate_tokens
            if ttft_ms is not None:
                counters.requests_with_first_token += 1
                counters.total_ttft_ms += ttft_ms
        if ttft_ms and cached_tokens == 0 and prompt_tokens > 0:
            self.chooser.prefill.add(prompt_tokens, ttft_ms / 1000)

    def add_load(self, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self._counters.load_bytes += num_bytes
            self._counters.load_seconds += seconds

    def add_tier_load(self, load: TierLoad) -> None:
        """One request's placement from one tier; its time reaches the tier's cost model once its copies completed
        (on CUDA, a later call sees it: nothing waits for the device here)."""
        with self._lock:
            counters = self._tiers.setdefault(load.tier, TierCounters())
            counters.chunks += load.num_chunks
            counters.bytes += load.num_bytes
            counters.seconds += load.seconds
            counters.loads += 1
            running, self._copies_running = [*self._copies_running, load], []
        for pending in running:
            seconds = loaded_seconds(pending)
            if seconds is None:
                with self._lock:
                    self._copies_running.append(pending)
            else:
                self.chooser.load_meter(pending.tier).add(pending.num_bytes, seconds)

    def choose_load(self, parts: Sequence[RunPart], question_tokens: int, bytes_per_token: int) -> LoadChoice:
        """What to load of a cached run (LoadChooser.choose); counts the tokens it recomputes and its probes."""
        choice = self.chooser.choose(parts, question_tokens, bytes_per_token)
        skipped = sum(part.num_tokens for part in parts) - choice.num_tokens
        with self._lock:
            self._counters.loads_skipped += skipped > 0
            self._counters.load_skipped_tokens += skipped
            self._counters.load_probes += bool(choice.probe)
        return choice

    def add_step_loop_lookups(self, num_lookups: int) -> None:
        with self._lock:
            self._counters.step_loop_lookups += num_lookups

    def add_guard(self, fell_back: bool) -> None:
        with self._lock:
            self._counters.guard_checks += 1
            self._counters.guard_fallbacks += fell_back

    def add_stored(self, chunks: int, num_bytes: int) -> None:
        with self._lock:
            self._counters.chunks_stored += chunks
            self._counters.bytes_stored += num_bytes

    def snapshot(self) -> dict:
        """Counters under ServiceStatsReply names, plus mean_ttft_ms and tier_loads ({tier: its TierCounters as a
        dict}: ServiceStatsReply.tier_loads, one TierLoad each)."""
        with self._lock:
            values = asdict(self._counters)
            values["tier_loads"] = {tier: asdict(counters) for tier, counters in sorted(self._tiers.items())}
        answered = values.pop("requests_with_first_token")
        total_ttft_ms = values.pop("total_ttft_ms")
        values["mean_ttft_ms"] = total_ttft_ms / answered if answered else 0.0
        return values
