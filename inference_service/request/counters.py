"""Thread-safe engine counters, reported under ServiceStatsReply field names."""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

from inference_service.reuse.tier_rates import RateMeter, load_is_slower

# A full prefill shorter than this is mostly fixed cost (tokenizing, the first token), not a rate; and a rate counts
# only after this many samples, so one request's stall does not send the next ones to recompute.
MIN_PREFILL_SAMPLE_TOKENS = 256
MIN_RATE_SAMPLES = 3


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
    loads_skipped: int = 0  # requests that recomputed cached tokens because their tier loads slower (skip_load)
    load_skipped_tokens: int = 0  # those tokens
    requests_with_first_token: int = 0
    total_ttft_ms: float = 0.0
    step_loop_lookups: int = 0  # Lookups the step loop asked (the early one missing or out of date, or a second)


@dataclass(slots=True)
class TierCounters:
    """What one tier (l0, daemon_map, daemon_fetch, store) placed into requests' slots."""

    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # host seconds from the tier's first read to its last copy issued
    loads: int = 0  # requests it placed chunks for


class EngineStats:
    def __init__(self) -> None:
        self._counters = _Counters()
        self._tiers: dict[str, TierCounters] = {}
        self._tier_rates: dict[str, RateMeter] = {}  # K/V bytes per second each tier placed
        self.prefill_rate = RateMeter()  # prompt tokens per second of requests that reused nothing (to first token)
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
        if ttft_ms and cached_tokens == 0 and prompt_tokens >= MIN_PREFILL_SAMPLE_TOKENS:
            self.prefill_rate.add(prompt_tokens, ttft_ms / 1000)

    def add_load(self, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self._counters.load_bytes += num_bytes
            self._counters.load_seconds += seconds

    def add_tier_load(self, tier: str, chunks: int, num_bytes: int, seconds: float) -> None:
        """One request's placement from one tier (see reuse.tier_rates.TierLoad)."""
        with self._lock:
            counters = self._tiers.setdefault(tier, TierCounters())
            counters.chunks += chunks
            counters.bytes += num_bytes
            counters.seconds += seconds
            counters.loads += 1
            meter = self._tier_rates.setdefault(tier, RateMeter())
        meter.add(num_bytes, seconds)

    def skip_load(self, tier: str, num_tokens: int, bytes_per_token: int) -> bool:
        """Whether recomputing num_tokens beats loading their K/V from `tier`, by this service's measured rates
        (reuse.tier_rates.load_is_slower; False until each has MIN_RATE_SAMPLES samples); counts a skip."""
        with self._lock:
            meter = self._tier_rates.get(tier)
        load_rate = meter.rate if meter is not None and meter.samples >= MIN_RATE_SAMPLES else None
        prefill_rate = self.prefill_rate.rate if self.prefill_rate.samples >= MIN_RATE_SAMPLES else None
        if not load_is_slower(num_tokens, bytes_per_token, load_rate, prefill_rate):
            return False
        with self._lock:
            self._counters.loads_skipped += 1
            self._counters.load_skipped_tokens += num_tokens
        return True

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
