"""The router's reuse estimate follows the mode a request will run in: a request that names none runs in its
replica's default (ModelInfo's default_mode), so content hits count only where that default reuses them."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvboost.v1 import cache_pb2
from kvboost.v1 import inference_pb2 as pb
from kvboost_keys.prompts import plan_prompt
from router.index import DaemonHoldings
from router.replicas import Replica
from router.routing import Router

NAMESPACE = bytes(32)
CHUNK_SIZE = 4


@dataclass
class StubReplica:
    """What Router reads of a replica."""

    index: int
    default_mode: int = pb.PREFIX_CACHE
    holdings: DaemonHoldings = field(default_factory=DaemonHoldings)
    healthy: bool = True
    degraded: bool = False
    load: int = 0
    num_routed: int = 0


def document_plan():
    return plan_prompt(NAMESPACE, [list(range(100, 116))], CHUNK_SIZE)  # 4 whole chunks


def holding_by_content_only(plan) -> DaemonHoldings:
    """A daemon that stored the plan's chunks after another prefix: their content keys, none of their prefix keys."""
    holdings = DaemonHoldings()
    for number, content_key in enumerate(plan.content_keys):
        holdings.apply(cache_pb2.KvEvent(sequence=number, kind=cache_pb2.KV_EVENT_STORED, tier=cache_pb2.KV_TIER_L1,
                                         namespace=NAMESPACE, prefix_key=bytes([number]) * 32,
                                         content_key=content_key, num_tokens=CHUNK_SIZE))
    return holdings


def routed_content_tokens(default_mode: int, request_mode: int) -> int:
    plan = document_plan()
    replicas = [StubReplica(0, default_mode, holding_by_content_only(plan)), StubReplica(1, default_mode)]
    router = Router(replicas, "prefix")
    router.route([plan], request_mode)
    return router.num_expected_content_tokens


def test_a_request_naming_no_mode_counts_no_content_reuse_on_an_exact_replica():
    assert routed_content_tokens(pb.PREFIX_CACHE, pb.MODE_UNSPECIFIED) == 0


def test_a_request_naming_no_mode_counts_content_reuse_where_the_replica_opted_in():
    assert routed_content_tokens(pb.CHUNK_KV_REUSE, pb.MODE_UNSPECIFIED) == 16


def test_the_request_mode_wins_over_the_replica_default():
    assert routed_content_tokens(pb.PREFIX_CACHE, pb.CHUNK_KV_REUSE) == 16
    assert routed_content_tokens(pb.CHUNK_KV_REUSE, pb.PREFIX_CACHE) == 0
    assert routed_content_tokens(pb.CHUNK_KV_REUSE, pb.BASELINE) == 0


def test_the_replica_keeps_the_default_mode_model_info_reports():
    replica = Replica.__new__(Replica)  # no channel needed: only the ModelInfo bookkeeping is exercised
    replica.record_model_info(pb.ModelInfoReply(default_mode=pb.PREFIX_CACHE))
    assert replica.default_mode == pb.PREFIX_CACHE
    replica.record_model_info(pb.ModelInfoReply(default_mode=pb.CHUNK_KV_REUSE))
    assert replica.default_mode == pb.CHUNK_KV_REUSE
    # A service older than the field defaulted to CHUNK_KV_REUSE.
    replica.record_model_info(pb.ModelInfoReply())
    assert replica.default_mode == pb.CHUNK_KV_REUSE
