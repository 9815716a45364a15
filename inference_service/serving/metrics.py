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
    "load_bytes": ("kvboost_engine_load_bytes", "K/V bytes placed from the cache (L0 and the daemon) into slots"),
    "load_seconds": ("kvboost_engine_load_seconds", "seconds from each request's Lookup to its last chunk in place"),
    "l0_chunks_hit": ("kvboost_engine_l0_chunks_hit", "whole chunks placed from L0, the service's own tier"),
    "l0_bytes_placed": ("kvboost_engine_l0_bytes_placed", "K/V bytes placed from L0"),
    "l0_chunks_evicted": ("kvboost_engine_l0_chunks_evicted", "chunks L0 dropped for room"),
    "approximate_answers": ("kvboost_engine_approximate_answers",
                            "answers that reused content hits (K/V computed under another prefix): labelled approximate"),
    "approximate_tokens": ("kvboost_engine_approximate_tokens",
                           "prompt tokens of approximate answers whose K/V came from content hits, not recomputed"),
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


def start_metrics_server(stats: Callable[[], dict], host: str, port: int) -> Callable[[], None]:
    """Serves /metrics over HTTP on host:port in a thread; returns the function that stops it."""
    return serve_collector(EngineCollector(stats), host, port)
