"""Prometheus metrics of the gateway, in a registry of its own (GET /metrics)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvboost_gateway_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.errors = Counter("kvboost_gateway_errors", "Error responses (and error chunks), by status and type",
                              ["status", "type"], registry=self.registry)
        self.aborted = Counter("kvboost_gateway_aborted_requests",
                               "Requests whose client went away before the end (the gRPC call was cancelled)",
                               ["endpoint"], registry=self.registry)
        self.ttft = Histogram("kvboost_gateway_ttft_seconds", "Request arrival to the first token, seen by the gateway",
                              ["endpoint"], buckets=_TTFT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("kvboost_gateway_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.cached_tokens = Counter("kvboost_gateway_cached_tokens", "Prompt tokens served from the KV cache",
                                     registry=self.registry)
        self.completion_tokens = Counter("kvboost_gateway_completion_tokens", "Generated tokens",
                                         registry=self.registry)

    def record_usage(self, usage: dict) -> None:
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.cached_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])
        self.completion_tokens.inc(usage["completion_tokens"])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
