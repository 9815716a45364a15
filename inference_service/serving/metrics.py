"""Prometheus metrics of the inference service, read from the engine's stats at scrape time (a private registry)."""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvboost_common.metrics_http import serve_collector

# stats field -> (metric name, help); gauges are the step loop's state, counters grow from start-up.
GAUGES = {
    "running_rows": ("kvboost_engine_running_rows", "rows decoding in the step loop (a request with n completions: n)"),
    "waiting_requests": ("kvboost_engine_waiting_requests", "requests queued, not yet admitted"),
    "kv_bytes_in_use": ("kvboost_engine_kv_bytes_in_use", "K/V bytes reserved by admitted requests"),
    "kv_budget_bytes": ("kvboost_engine_kv_budget_bytes", "K/V bytes admitted requests may reserve (--kv-cache-bytes)"),
    "l0_bytes_held": ("kvboost_engine_l0_bytes_held", "K/V bytes L0 holds now (--l0-bytes)"),
    "l0_chunks_held": ("kvboost_engine_l0_chunks_held", "whole chunks L0 holds now"),
    "host_bytes_held": ("kvboost_engine_host_bytes_held", "K/V bytes the pinned host tier holds now (--host-tier-bytes)"),
    "host_chunks_held": ("kvboost_engine_host_chunks_held", "whole chunks the pinned host tier holds now"),
    "tokenizer_cache_bytes": ("kvboost_engine_tokenizer_cache_bytes",
                              "bytes of token ids the tokenization cache holds now (--tokenizer-cache-bytes)"),
    "writebacks_in_flight": ("kvboost_engine_writebacks_in_flight",
                             "write-backs queued or running (L0 and the store taking answered requests' new chunks)"),
}
COUNTERS = {
    "requests": ("kvboost_engine_requests", "requests finished"),
    "prompt_tokens": ("kvboost_engine_prompt_tokens", "prompt tokens of finished requests"),
    "cached_tokens": ("kvboost_engine_cached_tokens", "prompt tokens whose K/V came from the cache"),
    "partial_cached_tokens": ("kvboost_engine_partial_cached_tokens",
                              "of the cached prompt tokens, those from stored partial chunks (the rest: whole chunks)"),
    "recomputed_tokens": ("kvboost_engine_recomputed_tokens", "cached prompt tokens whose K/V repair recomputed"),
    "computed_tokens": ("kvboost_engine_computed_tokens", "prompt tokens prefilled because nothing cached held them"),
    "guard_checks": ("kvboost_engine_guard_checks", "requests whose content hits the fidelity guard measured"),
    "guard_fallbacks": ("kvboost_engine_guard_fallbacks",
                        "requests the fidelity guard sent to full recompute of their content hits"),
    "step_loop_lookups": ("kvboost_engine_step_loop_lookups",
                          "Lookups the step loop asked itself (none asked at submission, as for a batch call, or out of date)"),
    "load_bytes": ("kvboost_engine_load_bytes", "K/V bytes placed from the cache (L0 and the daemon) into slots"),
    "load_seconds": ("kvboost_engine_load_seconds", "seconds from each request's Lookup to its last chunk in place"),
    "l0_chunks_hit": ("kvboost_engine_l0_chunks_hit", "whole chunks placed from L0, the service's own tier"),
    "l0_bytes_placed": ("kvboost_engine_l0_bytes_placed", "K/V bytes placed from L0"),
    "l0_chunks_evicted": ("kvboost_engine_l0_chunks_evicted", "chunks L0 dropped for room"),
    "host_chunks_hit": ("kvboost_engine_host_chunks_hit", "whole chunks placed from the pinned host tier"),
    "host_chunks_evicted": ("kvboost_engine_host_chunks_evicted", "chunks the host tier dropped for room"),
    "loads_skipped": ("kvboost_engine_loads_skipped",
                      "requests that recomputed cached K/V because their tier loads slower than prefill (measured)"),
    "load_skipped_tokens": ("kvboost_engine_load_skipped_tokens", "cached prompt tokens recomputed for that reason"),
    "load_probes": ("kvboost_engine_load_probes",
                    "requests that loaded a tier predicted slower than prefill, to measure it again"),
    "l0_chunks_alone": ("kvboost_engine_l0_chunks_alone",
                        "whole chunks L0 answered for alone: the daemon no longer held them (evicted; no Delete since)"),
    "l0_chunks_rejected": ("kvboost_engine_l0_chunks_rejected",
                           "chunks L0 did not keep: only their own prefix could have made room (it keeps a prompt's head)"),
    "tokenizer_cache_hits": ("kvboost_engine_tokenizer_cache_hits",
                             "pieces of prompt text (between special tokens) whose token ids came from the cache"),
    "tokenizer_cache_misses": ("kvboost_engine_tokenizer_cache_misses", "long pieces of prompt text tokenized and kept"),
    "tokenizer_cache_hit_tokens": ("kvboost_engine_tokenizer_cache_hit_tokens",
                                   "token ids served from the tokenization cache instead of the tokenizer"),
    "approximate_answers": ("kvboost_engine_approximate_answers",
                            "answers that reused content hits (K/V computed under another prefix): labelled approximate"),
    "approximate_tokens": ("kvboost_engine_approximate_tokens",
                           "prompt tokens of approximate answers whose K/V came from content hits, not recomputed"),
}
# stats["tier_loads"][tier] field -> (metric name, help), one series per tier (label tier: l0, host, daemon_map,
# daemon_fetch, store); a tier's rate is bytes / seconds.
TIER_COUNTERS = {
    "chunks": ("kvboost_engine_tier_chunks", "chunks a cache tier placed into requests' K/V slots"),
    "bytes": ("kvboost_engine_tier_bytes", "K/V bytes a cache tier placed into requests' slots"),
    "seconds": ("kvboost_engine_tier_seconds",
                "host seconds a cache tier took to place them, from its first read to its last copy issued"),
    "loads": ("kvboost_engine_tier_loads", "requests a cache tier placed chunks for"),
}


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        values = self._stats()
        for field, (name, description) in GAUGES.items():
            yield GaugeMetricFamily(name, description, value=values.get(field, 0))
        for field, (name, description) in COUNTERS.items():
            yield CounterMetricFamily(name, description, value=values.get(field, 0))
        tiers = values.get("tier_loads", {})
        for field, (name, description) in TIER_COUNTERS.items():
            family = CounterMetricFamily(name, description, labels=["tier"])
            for tier, counters in tiers.items():
                family.add_metric([tier], counters.get(field, 0))
            yield family


def start_metrics_server(stats: Callable[[], dict], host: str, port: int) -> Callable[[], None]:
    """Serves /metrics over HTTP on host:port in a thread; returns the function that stops it."""
    return serve_collector(EngineCollector(stats), host, port)
