"""Two daemons, each with its own LMDB, sharing one real redis-server as L2 (in-process gRPC servers)."""
from __future__ import annotations

import threading
import time
import urllib.request
from contextlib import ExitStack

import grpc
import pytest
from kvboost.v1 import cache_pb2

from cache_daemon.l2.redis_tier import L2Unavailable
from tests.conftest import pick_free_port
from tests.daemon_support import (NAMESPACE, cache_stub, digest, fetch_chunks, make_chunk, rpc_error,
                                  running_daemon, store_chunks, store_frames)
from tests.redis_support import RedisNode, redis_node, requires_redis

pytestmark = requires_redis


def stats(stub) -> cache_pb2.CacheStatsReply:
    return stub.Stats(cache_pb2.CacheStatsRequest())


def lookup(stub, keys, content_keys=()) -> cache_pb2.LookupReply:
    return stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys, content_keys=content_keys))


@pytest.fixture()
def redis(tmp_path):
    with redis_node(tmp_path / "redis") as node:
        yield node


@pytest.fixture()
def two_hosts(tmp_path, redis):
    """Daemons A and B (separate LMDB dirs) on the same L2, with write-behind."""
    with ExitStack() as stack:
        hosts = [stack.enter_context(running_daemon(tmp_path / name, l2=redis.url)) for name in ("a", "b")]
        yield hosts


def test_a_chunk_stored_on_host_a_is_found_fetched_and_promoted_on_host_b(two_hosts):
    host_a, host_b = two_hosts
    chunks = [make_chunk(index, 5000) for index in range(3)]
    with cache_stub(host_a.address) as stub_a, cache_stub(host_b.address) as stub_b:
        assert store_chunks(stub_a, chunks).stored == 3
        assert host_a.cache.drain_writes(10)
        # B's LMDB is empty: the whole run comes from L2, plus one key stored nowhere.
        reply = lookup(stub_b, [chunk.key for chunk in chunks] + [digest("never stored")])
        assert (reply.prefix_run, list(reply.prefix_hit)) == (3, [True, True, True, False])
        fetched = fetch_chunks(stub_b, [chunk.key for chunk in chunks])
        assert [chunk.blob for chunk in fetched] == [chunk.blob for chunk in chunks]
        b_stats = stats(stub_b)
        assert (b_stats.entries, b_stats.l2.hits, b_stats.l2.misses) == (3, 3, 1)  # promoted into B's LMDB
        # Stats carries L2's time and bytes: the three chunks promoted, none missing, none arriving now.
        assert (b_stats.l2.promoted, b_stats.l2.not_arrived, b_stats.l2.arriving) == (3, 0, 0)
        assert b_stats.l2.promoted_bytes >= 3 * 5000 and b_stats.l2.seconds > 0
        assert stats(stub_a).l2.writes == 3 and not b_stats.l2.degraded
        # Now an L1 hit on B: L2 is not asked again.
        lookup(stub_b, [chunk.key for chunk in chunks])
        assert stats(stub_b).l2.hits == 3


def test_a_content_hit_warmed_on_host_a_is_found_on_host_b_in_another_context(two_hosts):
    host_a, host_b = two_hosts
    document = make_chunk("doc in context 1", 4000, content_key=digest("document tokens"))
    with cache_stub(host_a.address) as stub_a, cache_stub(host_b.address) as stub_b:
        store_chunks(stub_a, [document])
        assert host_a.cache.drain_writes(10)
        # On B the same tokens come after another prefix: a different prefix key, the same content key.
        keys, content_keys = [digest("system prompt"), digest("doc in context 2")], [b"", document.content_key]
        # L2's content sets are unverified until their records are read: the first Lookup answers from
        # LMDB alone (no hit) and promotes the candidate, checked against its signed header.
        reply = lookup(stub_b, keys, content_keys)
        assert (reply.prefix_run, list(reply.content_hits)) == (0, [])
        assert host_b.cache.wait_for_promotions(10)
        reply = lookup(stub_b, keys, content_keys)
        assert [(hit.index, hit.stored_key) for hit in reply.content_hits] == [(1, document.key)]
        assert fetch_chunks(stub_b, [document.key])[0].blob == document.blob


def test_a_corrupted_l2_record_is_a_miss_and_is_deleted(two_hosts, redis):
    host_a, host_b = two_hosts
    chunk = make_chunk("to corrupt", 3000)
    with cache_stub(host_a.address) as stub_a, cache_stub(host_b.address) as stub_b:
        store_chunks(stub_a, [chunk])
        assert host_a.cache.drain_writes(10)
        redis_key = b"kvb:chunk:" + chunk.key
        client = host_a.cache.l2._client
        value = bytearray(client.get(redis_key))
        value[-1] ^= 0xFF  # one flipped bit in the blob
        client.set(redis_key, bytes(value))
        # Lookup reads no value, so it reports the record arriving; its promotion finds the flip and
        # Fetch answers a miss (a reader's run ends there).
        assert list(lookup(stub_b, [chunk.key]).prefix_hit) == [True]
        assert [found.found for found in fetch_chunks(stub_b, [chunk.key])] == [False]
        assert list(lookup(stub_b, [chunk.key]).prefix_hit) == [False]
        assert client.exists(redis_key) == 0
        assert stats(stub_b).l2.corrupted == 1


def test_delete_by_namespace_and_by_key_reach_l2(two_hosts):
    host_a, host_b = two_hosts
    chunks = [make_chunk(f"delete {index}", 2000) for index in range(4)]
    with cache_stub(host_a.address) as stub_a, cache_stub(host_b.address) as stub_b:
        store_chunks(stub_a, chunks)
        assert host_a.cache.drain_writes(10)
        stub_a.Delete(cache_pb2.DeleteRequest(keys=[chunks[0].key]))
        assert list(lookup(stub_b, [chunks[0].key]).prefix_hit) == [False]
        # B holds none of the namespace in its LMDB: Delete by namespace still reaches L2.
        assert stub_b.Delete(cache_pb2.DeleteRequest(namespace=NAMESPACE)).deleted == 3
        assert list(lookup(stub_b, [chunk.key for chunk in chunks]).prefix_hit) == [False] * 4
        error = rpc_error(stub_b.Delete, cache_pb2.DeleteRequest(namespace=NAMESPACE))
        assert error.code().name == "NOT_FOUND"


def test_a_write_behind_still_queued_when_a_delete_ends_does_not_put_its_chunk_back_in_l2(two_hosts):
    """LMDB took the chunk, the Delete removed it from both tiers, then the write-behind reached Redis: the writer's
    epoch (before the Delete) keeps it out of L2, so no host finds it there."""
    host_a, host_b = two_hosts
    chunk = make_chunk("written behind a delete", 2000)
    queue = host_a.cache._writer
    write, release = queue._write, threading.Event()
    queue._write = lambda chunks: (release.wait(10), write(chunks))
    with cache_stub(host_a.address) as stub_a, cache_stub(host_b.address) as stub_b:
        epoch = lookup(stub_a, [chunk.key])
        stored = stub_a.Store(iter(store_frames([chunk], delete_epoch_id=epoch.delete_epoch_id,
                                                delete_count=epoch.delete_count)))
        assert stored.stored == 1  # in LMDB; its L2 write waits
        stub_a.Delete(cache_pb2.DeleteRequest(keys=[chunk.key]))
        release.set()
        assert host_a.cache.drain_writes(10)
        assert list(lookup(stub_b, [chunk.key]).prefix_hit) == [False]
        assert list(lookup(stub_a, [chunk.key]).prefix_hit) == [False]


@pytest.fixture()
def sync_writer(tmp_path, redis):
    """(host A with sync L2 writes, a stub of A, a stub of host B reading the same L2)."""
    with ExitStack() as stack:
        host_a = stack.enter_context(running_daemon(tmp_path / "a", l2=redis.url, l2_write="sync"))
        host_b = stack.enter_context(running_daemon(tmp_path / "b", l2=redis.url))
        yield host_a, stack.enter_context(cache_stub(host_a.address)), stack.enter_context(cache_stub(host_b.address))


def test_a_delete_that_begins_while_a_sync_write_reaches_redis_is_not_undone_by_it(sync_writer):
    """The Delete begins while the Store's write is on its way to Redis (after its check before the write): the
    check after the write removes the chunk from L2 again, whatever order the Delete's own L2 removal takes."""
    chunk = make_chunk("deleted during its sync write", 2000)
    host_a, stub_a, stub_b = sync_writer
    l2, deletes = host_a.cache.l2, host_a.cache.deletes
    put, began = l2.put, []

    def put_then_a_delete_begins(chunks, **options):
        put(chunks, **options)
        began.append(deletes.begin(None, keys=[chunk.key]))  # its L2 removal has not run yet

    l2.put = put_then_a_delete_begins
    epoch = lookup(stub_a, [chunk.key])
    stored = stub_a.Store(iter(store_frames([chunk], delete_epoch_id=epoch.delete_epoch_id,
                                            delete_count=epoch.delete_count)))
    assert stored.stored == 1 and len(began) == 1  # LMDB took it before the Delete began
    assert list(lookup(stub_b, [chunk.key]).prefix_hit) == [False]  # but L2 holds it no longer
    deletes.end(began[0])


def test_a_sync_write_that_reached_redis_but_failed_is_checked_again_all_the_same(sync_writer):
    """The write landed after a Delete's L2 removal, then failed (no replica acknowledged): the check after the write
    still runs, so L2 does not keep the copy the Delete removed."""
    chunk = make_chunk("landed, then not acknowledged", 2000)
    host_a, stub_a, stub_b = sync_writer
    l2, deletes = host_a.cache.l2, host_a.cache.deletes
    put = l2.put

    def landed_then_failed(chunks, **options):
        stone = deletes.begin(None, keys=[chunk.key])  # a Delete begins after the check before the write ...
        l2.delete([chunk.key])  # ... and removes from L2 before the write lands
        put(chunks, **options)
        deletes.end(stone)
        raise L2Unavailable("WAIT: 0 of 1 replicas acknowledged")

    l2.put = landed_then_failed
    epoch = lookup(stub_a, [chunk.key])
    error = rpc_error(stub_a.Store, iter(store_frames([chunk], delete_epoch_id=epoch.delete_epoch_id,
                                                      delete_count=epoch.delete_count)))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert list(lookup(stub_b, [chunk.key]).prefix_hit) == [False]


def test_a_lookup_while_a_write_reaches_redis_after_a_delete_promotes_nothing_back_into_lmdb(tmp_path, redis):
    """A whole Delete runs between the check before the write-behind and the write landing in Redis; a Lookup in
    that window must not take the key from L2 (its promotion would store the deleted chunk in LMDB again)."""
    chunk = make_chunk("promoted in the window", 2000)
    with running_daemon(tmp_path / "a", l2=redis.url) as host, cache_stub(host.address) as stub:
        put, window = host.cache.l2.put, []

        def a_delete_then_the_write_then_a_lookup(chunks, **options):
            stub.Delete(cache_pb2.DeleteRequest(keys=[chunk.key]))
            put(chunks, **options)
            window.append(list(lookup(stub, [chunk.key]).prefix_hit))
            host.cache.wait_for_promotions(10)

        host.cache.l2.put = a_delete_then_the_write_then_a_lookup
        epoch = lookup(stub, [chunk.key])
        stub.Store(iter(store_frames([chunk], delete_epoch_id=epoch.delete_epoch_id, delete_count=epoch.delete_count)))
        assert host.cache.drain_writes(10)
        assert window == [[False]] and host.cache.l1.entry(chunk.key) is None
        assert list(lookup(stub, [chunk.key]).prefix_hit) == [False]  # and L2 holds it no more


def test_sync_writes_are_in_l2_when_store_replies_and_survive_a_redis_restart_with_aof(tmp_path, redis):
    chunks = [make_chunk(f"sync {index}", 8000) for index in range(5)]
    with running_daemon(tmp_path / "a", l2=redis.url, l2_write="sync") as host_a:
        with cache_stub(host_a.address) as stub_a:
            assert store_chunks(stub_a, chunks).stored == 5  # no drain: acknowledged means in L2
    redis.kill()  # kill -9 of the whole Redis; appendfsync always kept every write
    redis.start()
    with running_daemon(tmp_path / "b", l2=redis.url) as host_b, cache_stub(host_b.address) as stub_b:
        assert lookup(stub_b, [chunk.key for chunk in chunks]).prefix_run == 5
        assert [chunk.blob for chunk in fetch_chunks(stub_b, [chunk.key for chunk in chunks])] == \
            [chunk.blob for chunk in chunks]


def test_l2_down_at_start_serves_from_lmdb_reports_degraded_and_reconnects(tmp_path, caplog):
    port = pick_free_port()
    url = f"redis://127.0.0.1:{port}"
    first, later = make_chunk("while down", 2000), make_chunk("after reconnect", 2000)
    metrics_port = pick_free_port()
    with running_daemon(tmp_path / "a", l2=url, l2_retry_interval_s=0.2, l2_timeout_s=0.5,
                        metrics_port=metrics_port) as host_a, \
            cache_stub(host_a.address) as stub_a:
        assert store_chunks(stub_a, [first]).stored == 1  # Store never waits on L2
        assert lookup(stub_a, [first.key, digest("absent")]).prefix_run == 1
        assert host_a.cache.drain_writes(10)
        down = stats(stub_a).l2
        assert down.degraded and down.dropped_writes == 1 and down.errors >= 1
        lookup(stub_a, [digest("absent")])
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "kvboost_l2_degraded 1.0" in metrics and "kvboost_l2_dropped_writes_total 1.0" in metrics
        outage_logs = [record for record in caplog.records if "serving from LMDB alone" in record.getMessage()]
        assert len(outage_logs) == 1, "an outage is logged once, not once per request"
        node = RedisNode(port, tmp_path / "redis", cluster=False).start()
        try:
            deadline = time.monotonic() + 10
            while stats(stub_a).l2.degraded and time.monotonic() < deadline:
                lookup(stub_a, [digest("absent")])  # a miss asks L2 again once the retry interval passed
                time.sleep(0.1)
            assert not stats(stub_a).l2.degraded
            assert any("answers again" in record.getMessage() for record in caplog.records)
            store_chunks(stub_a, [later])
            assert host_a.cache.drain_writes(10)
            with running_daemon(tmp_path / "b", l2=url) as host_b, cache_stub(host_b.address) as stub_b:
                assert list(lookup(stub_b, [later.key, first.key]).prefix_hit) == [True, False]
        finally:
            node.stop()


def test_a_sync_store_that_l2_cannot_take_is_unavailable_and_kept_in_lmdb(tmp_path):
    chunk = make_chunk("unacknowledged", 2000)
    url = f"redis://127.0.0.1:{pick_free_port()}"  # nothing listens there
    with running_daemon(tmp_path / "a", l2=url, l2_write="sync", l2_timeout_s=0.2, l2_retry_interval_s=0.1,
                        l2_sync_timeout_s=0.5) as host_a, cache_stub(host_a.address) as stub_a:
        error = rpc_error(store_chunks, stub_a, [chunk])
        assert error.code().name == "UNAVAILABLE"
        assert "stored in this host's LMDB, not acknowledged by L2" in error.details()
        assert lookup(stub_a, [chunk.key]).prefix_run == 1  # this host still serves it
