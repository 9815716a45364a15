"""Prometheus metrics, read from the cache's stats at scrape time, on a private registry."""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvboost_common.metrics_http import serve_collector
from cache_daemon.cache import CacheStats, ChunkCache
from cache_daemon.events import JournalStats


REFUSAL_REASONS = ("unauthenticated", "permission_denied", "store_limit", "store_deadline")


class Refusals:
    """Calls refused since start, by reason (thread-safe: the interceptor and the servicer count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def count(self, reason: str) -> None:
        assert reason in REFUSAL_REASONS, f"unknown refusal reason {reason!r}"
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {reason: self._counts[reason] for reason in REFUSAL_REASONS}


class CallsInFlight:
    """Calls whose handler is running, by method (Store, Fetch, ...): what a SIGTERM waits for. Counted by the
    request-context interceptor, so a call counts once its handler has started, not when bytes arrive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def enter(self, method: str) -> None:
        with self._lock:
            self._counts[method] += 1

    def leave(self, method: str) -> None:
        with self._lock:
            self._counts[method] -= 1
            if not self._counts[method]:
                del self._counts[method]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def describe(self) -> str:
        counts = self.snapshot()
        total = sum(counts.values())
        return f"{total} call{'s' if total != 1 else ''} in flight" + (
            " (" + ", ".join(f"{method} {count}" for method, count in sorted(counts.items())) + ")" if total else "")


class CacheCollector(Collector):
    def __init__(self, cache: ChunkCache, refusals: Refusals | None = None,
                 namespace_owner: Callable[[bytes], str | None] | None = None,
                 in_flight: CallsInFlight | None = None) -> None:
        self._cache = cache
        self._refusals = refusals
        self._namespace_owner = namespace_owner
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        stats: CacheStats = self._cache.stats()
        counters = stats.counters
        yield _gauge("kvboost_cache_entries", "Stored chunks.", stats.num_entries)
        yield _gauge("kvboost_cache_bytes", "Stored blob bytes (bounded by --max-bytes).", stats.num_bytes)
        yield _gauge("kvboost_cache_max_bytes", "The --max-bytes budget.", stats.max_bytes)
        yield _gauge("kvboost_cache_map_size_bytes", "LMDB map size.", stats.map_size)
        yield _gauge("kvboost_cache_unflushed_hits", "Hits not yet written to LMDB (write-behind).",
                     stats.num_unflushed_hits)
        yield _counter("kvboost_cache_hits", "Keys found by Lookup or Fetch.", counters.hits)
        yield _counter("kvboost_cache_misses", "Keys not found by Lookup or Fetch.", counters.misses)
        yield _counter("kvboost_cache_evictions", "Chunks evicted to stay inside the budget.", counters.evictions)
        yield _counter("kvboost_cache_corrupted", "Blobs that failed their CRC-32 and were deleted.",
                       counters.corrupted)
        yield _counter("kvboost_cache_read_bytes", "Blob bytes served by Fetch.", counters.bytes_read)
        yield _counter("kvboost_cache_written_bytes", "Blob bytes committed by Store.", counters.bytes_written)
        yield _counter("kvboost_cache_superseded", "Stored chunks left out: a Delete their writer's delete epoch did "
                       "not count named them.", counters.superseded)
        namespace_bytes = GaugeMetricFamily("kvboost_cache_namespace_bytes", "Stored blob bytes per namespace.",
                                            labels=["namespace"])
        for namespace, usage in stats.namespaces.items():
            namespace_bytes.add_metric([namespace.hex()[:16]], usage.num_bytes)
        yield namespace_bytes
        if self._refusals is not None:
            refused = CounterMetricFamily("kvboost_cache_refusals", "Calls refused, by reason: unauthenticated "
                                          "(no known bearer token), permission_denied (the role may not), "
                                          "store_limit (a Store stream beyond --max-store-chunks or "
                                          "--max-store-bytes), store_deadline (still open at --store-deadline).",
                                          labels=["reason"])
            for reason, count in self._refusals.snapshot().items():
                refused.add_metric([reason], count)
            yield refused
        if self._in_flight is not None:
            in_flight = GaugeMetricFamily("kvboost_cache_calls_in_flight", "Calls whose handler is running now, by "
                                          "method (a SIGTERM lets them finish within --shutdown-grace).",
                                          labels=["method"])
            for method, count in sorted(self._in_flight.snapshot().items()):
                in_flight.add_metric([method], count)
            yield in_flight
        yield from _event_metrics(self._cache.events.stats())
        if self._namespace_owner is not None:
            yield self._tenant_bytes(stats)
        l2_stats = getattr(self._cache, "l2_stats", None)  # a TieredCache: LMDB under a shared L2
        if l2_stats is not None:
            yield from _l2_metrics(l2_stats())

    def _tenant_bytes(self, stats: CacheStats) -> Metric:
        """Stored blob bytes per tenant ("" for chunks stored by an admin or before tenancy)."""
        totals: Counter[str] = Counter()
        for namespace, usage in stats.namespaces.items():
            totals[self._namespace_owner(namespace) or ""] += usage.num_bytes
        tenant_bytes = GaugeMetricFamily("kvboost_cache_tenant_bytes", "Stored blob bytes per tenant.",
                                         labels=["tenant"])
        for tenant, num_bytes in sorted(totals.items()):
            tenant_bytes.add_metric([tenant], num_bytes)
        return tenant_bytes


def _event_metrics(events: JournalStats) -> Iterator[Metric]:
    published = CounterMetricFamily("kvboost_events_published", "KV events published to WatchEvents, by kind.",
                                    labels=["kind"])
    for kind, count in events.published.items():
        published.add_metric([kind.value], count)
    yield published
    lost = CounterMetricFamily("kvboost_events_lost", "Watch streams answered 'lost' (then resynced from a snapshot), "
                               "by reason.", labels=["reason"])
    for reason, count in events.lost.items():
        lost.add_metric([reason], count)
    yield lost
    yield _counter("kvboost_events_dropped", "Events watchers did not receive one by one (too slow, or reconnected "
                   "behind the history) and resynced from a snapshot instead.", events.num_dropped)
    yield _gauge("kvboost_events_watchers", "Open WatchEvents streams.", events.num_watchers)
    yield _gauge("kvboost_events_history", "Events held for watchers (at most --event-history).", events.num_held)
    yield _gauge("kvboost_events_next_sequence", "Sequence the next daemon-wide event gets.", events.next_sequence)


def _l2_metrics(l2) -> Iterator[Metric]:
    yield _gauge("kvboost_l2_degraded", "1 while the shared L2 tier does not answer (LMDB serves alone).",
                 int(l2.degraded))
    yield _counter("kvboost_l2_hits", "Keys LMDB missed and L2 held (promoted into LMDB).", l2.hits)
    yield _counter("kvboost_l2_misses", "Keys missing in both tiers.", l2.misses)
    yield _counter("kvboost_l2_writes", "Chunks written to L2.", l2.writes)
    yield _counter("kvboost_l2_dropped_writes", "Chunks not written to L2: queue full or L2 down.",
                   l2.dropped_writes)
    yield _counter("kvboost_l2_corrupted", "L2 records that failed their CRC-32 (deleted).", l2.corrupted)
    yield _counter("kvboost_l2_forged", "L2 records whose MAC failed (forged, altered or copied under another key), "
                   "or signed with a key id not in --l2-key-file: served as misses.", l2.forged)
    yield _counter("kvboost_l2_promotion_batches", "Batches of L2 hits copied into LMDB (each at most "
                   "--l2-promote-batch chunks).", l2.promotion_batches)
    yield _gauge("kvboost_l2_calls_in_flight", "Calls waiting on Redis now (in the daemon's own L2 threads, apart "
                 "from Fetch's).", l2.calls_in_flight)
    yield _counter("kvboost_l2_errors", "Failed calls to L2.", l2.errors)
    yield _counter("kvboost_l2_promoted", "Chunks a Lookup reported from L2 and promoted into LMDB after it.",
                   l2.promoted)
    yield _counter("kvboost_l2_promoted_bytes", "Blob bytes promoted from L2 into LMDB.", l2.promoted_bytes)
    yield _counter("kvboost_l2_not_arrived", "Chunks a Lookup reported from L2 that never reached LMDB (gone, "
                   "failing their MAC, or past the promotion's deadline): a reader's run ends there.", l2.not_arrived)
    yield _counter("kvboost_l2_arrival_waits", "Fetch reads that waited for a chunk still arriving from L2.",
                   l2.arrival_waits)
    yield _gauge("kvboost_l2_arriving", "Chunks on their way from L2 into LMDB now.", l2.arriving)
    yield _counter("kvboost_l2_seconds", "Time spent on L2 by Lookups' value-free checks and by promotions.",
                   l2.seconds)
    yield _gauge("kvboost_l2_queued_writes", "Chunks waiting in the L2 write-behind queue.", l2.queued_writes)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def start_metrics_server(cache: ChunkCache, host: str, port: int, refusals: Refusals | None = None,
                         namespace_owner: Callable[[bytes], str | None] | None = None,
                         in_flight: CallsInFlight | None = None) -> Callable[[], None]:
    """Serves /metrics over HTTP on host:port in a thread; returns the function that stops it."""
    return serve_collector(CacheCollector(cache, refusals, namespace_owner, in_flight), host, port)
