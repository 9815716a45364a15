"""The router's Stats: the healthy replicas' ServiceStatsReply added up (per replica figures are on /metrics)."""
from __future__ import annotations

from typing import Sequence

from kvboost.v1 import inference_pb2 as pb

# Fields that are not counts: each has its own way of combining.
_COMBINED_APART = frozenset({"degraded", "cache_address", "mean_ttft_ms", "read_mode", "tier_loads"})


def sum_stats(replies: Sequence[pb.ServiceStatsReply]) -> pb.ServiceStatsReply:
    """Counters and gauges summed; degraded when any replica is; the daemons' addresses and read modes listed
    (distinct, comma-separated); mean TTFT weighted by each replica's requests."""
    total = pb.ServiceStatsReply()
    for field in pb.ServiceStatsReply.DESCRIPTOR.fields:
        if field.name not in _COMBINED_APART:
            setattr(total, field.name, sum(getattr(reply, field.name) for reply in replies))
    total.degraded = any(reply.degraded for reply in replies)
    total.cache_address = ",".join(dict.fromkeys(reply.cache_address for reply in replies if reply.cache_address))
    total.read_mode = ",".join(dict.fromkeys(reply.read_mode for reply in replies if reply.read_mode))
    if total.requests:
        total.mean_ttft_ms = sum(reply.mean_ttft_ms * reply.requests for reply in replies) / total.requests
    total.tier_loads.extend(sum_tier_loads(replies))
    return total


def sum_tier_loads(replies: Sequence[pb.ServiceStatsReply]) -> list[pb.TierLoad]:
    """Each tier's loads added up across the replicas, tiers in order of first appearance."""
    tiers: dict[str, pb.TierLoad] = {}
    for reply in replies:
        for load in reply.tier_loads:
            total = tiers.setdefault(load.tier, pb.TierLoad(tier=load.tier))
            total.chunks += load.chunks
            total.bytes += load.bytes
            total.seconds += load.seconds
            total.loads += load.loads
    return list(tiers.values())
