"""sum_stats: the router's Stats adds its replicas' up."""
from __future__ import annotations

from kvboost.v1 import inference_pb2 as pb
from router.stats import sum_stats


def test_counts_add_up_and_the_rest_combines_by_meaning():
    first = pb.ServiceStatsReply(requests=3, cached_tokens=100, running_rows=2, mean_ttft_ms=10.0,
                                 cache_address="a:1", read_mode="locked_map")
    second = pb.ServiceStatsReply(requests=1, cached_tokens=50, running_rows=1, mean_ttft_ms=50.0, degraded=True,
                                  cache_address="b:2", read_mode="locked_map")
    total = sum_stats([first, second])
    assert (total.requests, total.cached_tokens, total.running_rows) == (4, 150, 3)
    assert total.mean_ttft_ms == 20.0  # (3 * 10 + 1 * 50) / 4
    assert total.degraded and total.cache_address == "a:1,b:2" and total.read_mode == "locked_map"


def test_tier_loads_add_up_per_tier():
    first = pb.ServiceStatsReply(tier_loads=[pb.TierLoad(tier="l0", chunks=2, bytes=200, seconds=0.5, loads=1)])
    second = pb.ServiceStatsReply(tier_loads=[pb.TierLoad(tier="daemon_map", chunks=1, bytes=50, seconds=0.25, loads=1),
                                              pb.TierLoad(tier="l0", chunks=3, bytes=300, seconds=0.5, loads=2)])
    loads = {load.tier: (load.chunks, load.bytes, load.seconds, load.loads)
             for load in sum_stats([first, second]).tier_loads}
    assert loads == {"l0": (5, 500, 1.0, 3), "daemon_map": (1, 50, 0.25, 1)}
