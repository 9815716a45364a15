"""/metrics: the engine's stats as Prometheus families, per-tier loads labelled by tier."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from inference_service.engine_parts.counters import EngineStats
from inference_service.kv_memory.tier_rates import TierLoad
from inference_service.serving.metrics import EngineCollector


def test_per_tier_loads_are_counters_labelled_by_tier():
    counters = EngineStats()
    counters.add_tier_load(TierLoad("l0", 4, 4096, 0.001))
    counters.add_tier_load(TierLoad("daemon_map", 2, 2048, 0.004))
    counters.add_tier_load(TierLoad("l0", 1, 1024, 0.001))
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: {**counters.snapshot(), "l0_chunks_rejected": 3}))
    text = generate_latest(registry).decode()
    assert 'kvboost_engine_tier_bytes_total{tier="l0"} 5120.0' in text
    assert 'kvboost_engine_tier_chunks_total{tier="daemon_map"} 2.0' in text
    assert 'kvboost_engine_tier_seconds_total{tier="daemon_map"} 0.004' in text
    assert 'kvboost_engine_tier_loads_total{tier="l0"} 2.0' in text
    assert "kvboost_engine_l0_chunks_rejected_total 3.0" in text
    assert counters.snapshot()["tier_loads"]["l0"] == {"chunks": 5, "bytes": 5120, "seconds": 0.002, "loads": 2}
