"""A real 3-primary/3-replica Redis Cluster under two daemon processes: cross-host hits, and a primary
killed with -9 in the middle of a load (no failed Lookup, no acknowledged chunk lost under sync writes)."""
from __future__ import annotations

import threading

import grpc
from kvboost.v1 import cache_pb2

from tests.conftest import pick_free_port, wait_for
from tests.daemon_support import NAMESPACE, cache_stub, digest, make_chunk, store_chunks
from tests.e2e.daemon_process import start_daemon
from tests.redis_support import redis_cluster, requires_redis

pytestmark = requires_redis
L2_FLAGS = ("--l2-timeout", "0.5", "--l2-retry-interval", "0.2")


def lookup(stub, keys) -> cache_pb2.LookupReply:
    return stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys), timeout=30)


class Load:
    """One thread storing 1-chunk requests (sync L2 writes) and looking up what it stored plus a
    key stored nowhere (so every Lookup asks L2)."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.acknowledged: list[bytes] = []
        self.num_store_refusals = 0
        self.lookup_errors: list[str] = []
        self.num_lookups = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        index = 0
        while not self._stop.is_set():
            chunk = make_chunk(f"load {index}", 20_000)
            index += 1
            try:
                store_chunks(self.stub, [chunk], timeout=30)
                self.acknowledged.append(chunk.key)
            except grpc.RpcError as error:  # not acknowledged: L2 could not confirm a replica in time
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                self.num_store_refusals += 1
            try:
                reply = lookup(self.stub, self.acknowledged[-5:] + [digest(f"absent {index}")])
                assert reply.prefix_run == min(5, len(self.acknowledged)), "an acknowledged chunk went missing"
                self.num_lookups += 1
            except (grpc.RpcError, AssertionError) as error:
                self.lookup_errors.append(str(error))

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def test_primary_killed_mid_load_loses_no_acknowledged_chunk_and_fails_no_lookup(tmp_path):
    with redis_cluster(tmp_path / "cluster") as cluster:
        host_a = start_daemon(tmp_path / "a", pick_free_port(), "--l2", cluster.url, "--l2-write", "sync", *L2_FLAGS)
        try:
            with cache_stub(host_a.address) as stub_a, Load(stub_a) as load:
                before_kill = wait_for(lambda: len(load.acknowledged) >= 10 and len(load.acknowledged),
                                       "the load to get chunks acknowledged")
                victim = cluster.primaries()[0]
                victim.kill()  # kill -9 of a primary; its replica takes over after the node timeout
                wait_for(lambda: len(cluster.primaries()) == 3, "a replica to be promoted", timeout_s=30.0)
                wait_for(lambda: len(load.acknowledged) >= before_kill + 10, "the load to go on through the failover",
                         timeout_s=60.0)
                victim.start()  # it rejoins as a replica, so WAIT 1 holds again on that shard
                cluster.wait_ok()
                rejoined = len(load.acknowledged)
                wait_for(lambda: len(load.acknowledged) >= rejoined + 10, "stores after the old primary rejoined",
                         timeout_s=60.0)
            assert before_kill > 0 and len(load.acknowledged) > before_kill
            assert load.lookup_errors == [] and load.num_lookups > 0
            a_stats = stub_a_stats(host_a.address)
            assert a_stats.l2.writes == len(load.acknowledged)
        finally:
            host_a.terminate()
        # A new host with an empty LMDB finds every acknowledged chunk in the cluster.
        host_b = start_daemon(tmp_path / "b", pick_free_port(), "--l2", cluster.url, *L2_FLAGS)
        try:
            with cache_stub(host_b.address) as stub_b:
                held = lookup(stub_b, load.acknowledged).prefix_hit
                lost = [key.hex()[:16] for key, hit in zip(load.acknowledged, held) if not hit]
                assert lost == [], f"{len(lost)} of {len(load.acknowledged)} acknowledged chunks lost"
        finally:
            host_b.terminate()
        print(f"acknowledged {len(load.acknowledged)}, refused {load.num_store_refusals}, "
              f"lookups {load.num_lookups}, failed lookups {len(load.lookup_errors)}")


def stub_a_stats(address: str) -> cache_pb2.CacheStatsReply:
    with cache_stub(address) as stub:
        return stub.Stats(cache_pb2.CacheStatsRequest())
