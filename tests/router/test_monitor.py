"""ReplicaMonitor and Replica.load: health and Stats read from scripted replicas decide who is routed to."""
from __future__ import annotations

import asyncio

import pytest

from kvboost.v1 import inference_pb2 as pb
from router.config import ReplicaAddress
from router.model_identity import ModelIdentity
from router.monitor import ReplicaMonitor
from router.replicas import Replica, open_channel
from tests.router.fake_replicas import router_in_front

pytestmark = pytest.mark.timeout(60)


def test_load_is_this_routers_in_flight_plus_other_work_the_replica_reported():
    async def replica_never_called() -> Replica:
        address = ReplicaAddress("127.0.0.1:1", "127.0.0.1:2")
        return Replica(0, address, open_channel(address.service, False, "", 1 << 20))

    replica = asyncio.run(replica_never_called())
    with replica.routed(), replica.routed():
        # Asked while 2 of ours ran; it reported 5 running or queued: 3 are other clients'.
        replica.record_stats(pb.ServiceStatsReply(running_rows=4, waiting_requests=1), in_flight_when_asked=2)
        assert replica.load == 5
    assert replica.load == 3 and replica.num_routed == 2
    replica.record_stats(pb.ServiceStatsReply(running_rows=0, degraded=True), in_flight_when_asked=0)
    assert replica.load == 0 and replica.degraded


def test_a_replica_not_serving_or_gone_is_skipped_and_found_again():
    async def scenario():
        async with router_in_front() as (_, fakes, router):
            identity = ModelIdentity.from_reply(fakes[0].info)
            monitor = ReplicaMonitor(router.replicas, identity, interval_s=0.1)
            fakes[0].stats = pb.ServiceStatsReply(running_rows=2, waiting_requests=1)
            await monitor.probe_all()
            seen = [(replica.healthy, replica.load) for replica in router.replicas]
            await fakes[0].set_serving(False)
            await router.servers[1].stop(0)
            await monitor.probe_all()
            gone = [replica.healthy for replica in router.replicas]
            await fakes[0].set_serving(True)
            await monitor.probe_all()
            return seen, gone, router.replicas[0].healthy

    seen, gone, back = asyncio.run(scenario())
    assert seen == [(True, 3), (True, 0)]
    assert gone == [False, False] and back


def test_a_replica_back_with_other_keys_is_not_routed_to():
    async def scenario():
        async with router_in_front() as (_, fakes, router):
            identity = ModelIdentity.from_reply(fakes[0].info)
            monitor = ReplicaMonitor(router.replicas, identity, interval_s=0.1)
            router.replicas[1].healthy = False  # it went away; it comes back restarted with another chunk size
            fakes[1].info = pb.ModelInfoReply(model="m", namespace_hex="00" * 32, chunk_size=8, kv_cache_bits=16)
            await monitor.probe_all()
            refused = router.replicas[1].healthy
            fakes[1].info = fakes[0].info
            await monitor.probe_all()
            return refused, router.replicas[1].healthy

    assert asyncio.run(scenario()) == (False, True)
