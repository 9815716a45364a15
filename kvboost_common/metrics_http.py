"""Prometheus /metrics over HTTP for one collector on a private registry (the daemon's and the service's)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.registry import Collector


def serve_collector(collector: Collector, host: str, port: int) -> Callable[[], None]:
    """Serves the collector's metrics on http://host:port/metrics in a thread; returns the function that stops it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()
    return stop
