"""Lookup answers L2 chunks from a value-free check; their values arrive after it, and Fetch waits for them
(two in-process daemons on one real redis-server)."""
from __future__ import annotations

import threading
import time
import urllib.request

from kvboost.v1 import cache_pb2

from cache_daemon.entry import ChunkKey
from cache_daemon.l2.redis_tier import CHUNK_PREFIX
from tests.conftest import pick_free_port
from tests.daemon_support import NAMESPACE, cache_stub, fetch_chunks, make_chunk, running_daemon, store_chunks
from tests.cache_daemon.test_tiered import redis, two_hosts  # noqa: F401 (fixtures: Redis, daemons A and B on it)
from tests.redis_support import requires_redis

pytestmark = requires_redis




def lookup(stub, keys) -> cache_pb2.LookupReply:
    return stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys), timeout=10)


def warm_on_a(host_a, chunks) -> list[bytes]:
    """Stores the chunks on host A and waits until they are in L2; their keys."""
    with cache_stub(host_a.address) as stub_a:
        assert store_chunks(stub_a, chunks).stored == len(chunks)
    assert host_a.cache.drain_writes(20)
    return [chunk.key for chunk in chunks]


class GatedReads:
    """Holds the daemon's L2 value reads (promotions) until `opened` is set; counts them. read_first: each reads
    first and holds what it read (else it reads once the gate opens). `waiting` is released as each one holds."""

    def __init__(self, tier, read_first: bool = False) -> None:
        self.opened = threading.Event()
        self.waiting = threading.Semaphore(0)
        self.num_reads = 0
        self.read_first = read_first
        self._get = tier.get
        tier.get = self

    def __call__(self, keys):
        self.num_reads += 1
        found = self._get(keys) if self.read_first else None
        self.waiting.release()
        assert self.opened.wait(30), "the test never opened the gate"
        return found if self.read_first else self._get(keys)


def test_a_lookup_of_l2_only_chunks_reads_no_value_and_fetch_waits_for_them(tmp_path, redis):
    metrics_port = pick_free_port()
    with running_daemon(tmp_path / "a", l2=redis.url) as host_a, \
            running_daemon(tmp_path / "b", l2=redis.url, metrics_port=metrics_port) as host_b:
        check_lookup_then_arrival(host_a, host_b, metrics_port)


def check_lookup_then_arrival(host_a, host_b, metrics_port: int) -> None:
    chunks = [make_chunk(f"big {index}", 1 << 20) for index in range(64)]  # 64 MiB only in L2
    keys = warm_on_a(host_a, chunks)
    gate = GatedReads(host_b.cache.l2)
    with cache_stub(host_b.address) as stub_b:
        started = time.perf_counter()
        reply = lookup(stub_b, keys)
        elapsed = time.perf_counter() - started
        # Answered while no value has been read: the promotion waits at the gate.
        assert reply.prefix_run == 64 and gate.waiting.acquire(timeout=10)
        assert elapsed < 0.5, f"a Lookup of 64 L2-only keys took {elapsed * 1000:.0f} ms"
        assert len(host_b.cache.promoter.arriving) == 64
        fetched: list = []
        reader = threading.Thread(target=lambda: fetched.extend(fetch_chunks(stub_b, keys)))
        reader.start()
        gate.opened.set()  # the values move now; Fetch has been waiting for the first of them
        reader.join(60)
    assert [chunk.blob for chunk in fetched] == [chunk.blob for chunk in chunks]
    assert host_b.cache.wait_for_promotions(30)
    l2 = host_b.cache.l2_stats()
    assert (l2.promoted, l2.promoted_bytes, l2.not_arrived, l2.arriving) == (64, 64 << 20, 0, 0)
    assert l2.arrival_waits >= 1 and l2.seconds > 0
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    values = {name: float(value) for name, value in (line.split() for line in metrics.splitlines()
                                                      if line.startswith("kvboost_l2_"))}
    assert (values["kvboost_l2_promoted_bytes_total"], values["kvboost_l2_promoted_total"]) == (64 << 20, 64)
    assert (values["kvboost_l2_not_arrived_total"], values["kvboost_l2_arriving"]) == (0, 0)
    assert values["kvboost_l2_seconds_total"] > 0


def test_a_chunk_failing_its_mac_or_gone_mid_run_is_a_miss_where_the_run_ends(two_hosts, redis):
    host_a, host_b = two_hosts
    chunks = [make_chunk(f"run {index}", 3000) for index in range(8)]
    keys = warm_on_a(host_a, chunks)
    client = host_a.cache.l2._client
    gate = GatedReads(host_b.cache.l2)
    with cache_stub(host_b.address) as stub_b:
        assert lookup(stub_b, keys).prefix_run == 8  # reported: the check reads lengths, not values
        # Between the answer and the promotion: chunk 3's record altered (its MAC fails), chunk 5's gone.
        altered = bytearray(client.get(CHUNK_PREFIX + keys[3]))
        altered[-1] ^= 0x01
        client.set(CHUNK_PREFIX + keys[3], bytes(altered))
        client.delete(CHUNK_PREFIX + keys[5])
        gate.opened.set()
        found = [chunk.found for chunk in fetch_chunks(stub_b, keys)]
    # A reader's run ends at the first miss (chunk 3); nothing bad is served anywhere.
    assert found == [True, True, True, False, True, False, True, True]
    assert host_b.cache.wait_for_promotions(30)
    l2 = host_b.cache.l2_stats()
    assert (l2.not_arrived, l2.promoted) == (2, 6)
    assert l2.forged + l2.corrupted == 1 and client.exists(CHUNK_PREFIX + keys[3]) == 0


def test_redis_restarting_mid_promotion_loses_nothing_stored(two_hosts, redis):
    host_a, host_b = two_hosts
    chunks = [make_chunk(f"restart {index}", 50_000) for index in range(6)]
    keys = warm_on_a(host_a, chunks)
    gate = GatedReads(host_b.cache.l2)
    with cache_stub(host_b.address) as stub_b:
        assert lookup(stub_b, keys).prefix_run == 6
        assert gate.waiting.acquire(timeout=10)
        redis.kill()  # kill -9 while the promotion is about to read the values
        gate.opened.set()
        # The promotion fails; every arriving key is released (no reader hangs) and is a miss.
        assert [chunk.found for chunk in fetch_chunks(stub_b, keys)] == [False] * 6
        assert host_b.cache.wait_for_promotions(30)
        redis.start()  # the same dir: its AOF holds every record A wrote
        deadline = time.monotonic() + 20
        while not all(lookup(stub_b, keys).prefix_hit):  # B's L2 retries once its retry interval has passed
            assert time.monotonic() < deadline, "L2 did not come back on B"
            time.sleep(0.05)
        fetched = fetch_chunks(stub_b, keys)
    assert [chunk.blob for chunk in fetched] == [chunk.blob for chunk in chunks]
    with cache_stub(host_a.address) as stub_a:  # A's LMDB never depended on Redis
        assert [chunk.blob for chunk in fetch_chunks(stub_a, keys)] == [chunk.blob for chunk in chunks]
    assert ChunkKey(keys[0]) not in host_b.cache.promoter.arriving.snapshot()


def test_a_delete_voids_the_promotions_in_flight_so_no_later_lookup_finds_what_it_deleted(two_hosts, redis):
    host_a, host_b = two_hosts
    chunks = [make_chunk(f"deleted mid-promotion {index}", 3000) for index in range(3)]
    keys = warm_on_a(host_a, chunks)
    gate = GatedReads(host_b.cache.l2, read_first=True)
    with cache_stub(host_b.address) as stub_b:
        before = lookup(stub_b, keys)
        assert before.prefix_run == 3 and gate.waiting.acquire(timeout=10)  # B's promotion holds all three, read
        stub_b.Delete(cache_pb2.DeleteRequest(keys=[keys[1]]), timeout=10)
        # The Delete has returned: a Lookup that starts now must not answer keys[1] (an inference service's L0
        # would take the answer, at the Delete's count, for this very chunk). The promotion's batch read before
        # the Delete, so none of it is stored: keys[0] and keys[2] are misses until a Lookup finds them in L2 again.
        after = lookup(stub_b, keys)
        assert list(after.prefix_hit)[1] is False and after.delete_count == before.delete_count + 1
        gate.opened.set()
        assert host_b.cache.wait_for_promotions(30)
        assert list(lookup(stub_b, keys).prefix_hit)[1] is False  # not stored after the Delete either
        again = lookup(stub_b, keys)  # the others come back from L2 through a promotion read after the Delete
        assert host_b.cache.wait_for_promotions(30)
        assert [chunk.found for chunk in fetch_chunks(stub_b, [keys[0]])] == [True]
        assert list(again.prefix_hit) == [True, False, True]
    assert host_b.cache.l1.probe(NAMESPACE, [keys[1]], []).prefix_hit == [False]
