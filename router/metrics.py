"""Prometheus metrics of the router, read from its replicas and their event feeds at scrape time."""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvboost_common.metrics_http import serve_collector
from router.replicas import Replica
from router.routing import Router

# (metric name, help, kind, value of a replica)
PER_REPLICA: tuple[tuple[str, str, str, Callable[[Replica], float]], ...] = (
    ("kvboost_router_replica_healthy", "1 while the replica serves the agreed model and answers", "gauge",
     lambda replica: float(replica.healthy)),
    ("kvboost_router_replica_degraded", "1 while the service says its daemon is out of reach (its cache counts "
     "for nothing)", "gauge", lambda replica: float(replica.degraded)),
    ("kvboost_router_replica_load", "running + queued requests there (this router's in-flight ones included)",
     "gauge", lambda replica: replica.load),
    ("kvboost_router_replica_in_flight", "requests this router has in flight there", "gauge",
     lambda replica: replica.in_flight),
    ("kvboost_router_replica_routed", "calls this router sent there", "counter", lambda replica: replica.num_routed),
    ("kvboost_router_replica_failed", "calls there that failed unreachable or with a full queue", "counter",
     lambda replica: replica.num_failed),
    ("kvboost_router_replica_indexed_chunks", "chunks its daemon holds in L1, as its events said", "gauge",
     lambda replica: replica.holdings.num_chunks),
    ("kvboost_router_replica_events_live", "1 while its daemon's events are followed live", "gauge",
     lambda replica: float(replica.events.live)),
    ("kvboost_router_replica_events", "daemon events applied to the index", "counter",
     lambda replica: replica.events.num_events),
    ("kvboost_router_replica_resyncs", "snapshots taken after the daemon said `lost`", "counter",
     lambda replica: replica.events.num_resyncs),
)


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        for name, description, kind, value in PER_REPLICA:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(name, description, labels=["replica"])
            for replica in self._router.replicas:
                family.add_metric([replica.address.service], value(replica))
            yield family
        yield CounterMetricFamily("kvboost_router_expected_exact_tokens",
                                  "prompt tokens the chosen replicas were expected to reuse exactly",
                                  value=self._router.num_expected_exact_tokens)
        yield CounterMetricFamily("kvboost_router_expected_content_tokens",
                                  "prompt tokens the chosen replicas were expected to reuse by content",
                                  value=self._router.num_expected_content_tokens)


def start_metrics_server(router: Router, host: str, port: int) -> Callable[[], None]:
    """Serves /metrics over HTTP on host:port in a thread; returns the function that stops it."""
    return serve_collector(RouterCollector(router), host, port)
