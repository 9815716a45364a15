"""Bounded daemon memory and time: Store streams (chunks, bytes, deadline), L2 promotion in batches charged
to the tenant, and Fetch of LMDB hits unaffected by a Redis that stopped answering (real redis-server)."""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvboost.v1 import cache_pb2

from tests.conftest import pick_free_port, wait_for
from tests.daemon_support import (NAMESPACE, cache_stub, digest, fetch_chunks, make_chunk, rpc_error, running_daemon,
                                  store_chunks, store_frames)
from tests.redis_support import redis_node, requires_redis


def metrics_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def lookup(stub, keys, **call_options) -> cache_pb2.LookupReply:
    return stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys), **call_options)


def test_a_flood_of_chunks_in_one_store_stream_is_refused_at_the_bound(tmp_path):
    metrics_port = pick_free_port()
    flood = [make_chunk(index, 100) for index in range(10_000)]
    with running_daemon(tmp_path / "d", max_store_chunks=100, metrics_port=metrics_port) as daemon, \
            cache_stub(daemon.address) as stub:
        error = rpc_error(store_chunks, stub, flood)
        assert error.code().name == "RESOURCE_EXHAUSTED"
        assert "more than 100 chunks (--max-store-chunks): split it into several Store calls" in error.details()
        assert stub.Stats(cache_pb2.CacheStatsRequest()).entries == 0, "a refused stream stores nothing"
        assert store_chunks(stub, flood[:100]).stored == 100  # at the bound: accepted
        assert 'kvboost_cache_refusals_total{reason="store_limit"} 1.0' in metrics_text(metrics_port)


def test_a_store_stream_beyond_its_byte_bound_is_refused_before_the_data_arrives(tmp_path):
    chunks = [make_chunk(index, 3000) for index in range(10)]
    with running_daemon(tmp_path / "d", max_store_bytes=10_000) as daemon, cache_stub(daemon.address) as stub:
        error = rpc_error(store_chunks, stub, chunks)
        assert error.code().name == "RESOURCE_EXHAUSTED"
        assert "more than 10000 blob bytes (--max-store-bytes" in error.details()
        assert store_chunks(stub, chunks[:3]).stored == 3


def test_a_store_stream_left_open_ends_at_the_server_side_deadline(tmp_path):
    metrics_port = pick_free_port()
    release = threading.Event()

    def stalled_stream():
        yield from store_frames([make_chunk("first", 500)])
        release.wait(30)  # a client that never finishes its stream (and set no deadline of its own)

    with running_daemon(tmp_path / "d", store_deadline_s=0.5, metrics_port=metrics_port) as daemon, \
            cache_stub(daemon.address) as stub:
        started = time.monotonic()
        try:
            error = rpc_error(stub.Store, stalled_stream())
        finally:
            release.set()
        assert error.code().name == "RESOURCE_EXHAUSTED" and time.monotonic() - started < 10
        assert "still open after --store-deadline=0.5 s (server side) with 1 chunks received" in error.details()
        assert 'kvboost_cache_refusals_total{reason="store_deadline"} 1.0' in metrics_text(metrics_port)


@pytest.fixture()
def redis(tmp_path):
    if requires_redis.args[0]:
        pytest.skip(requires_redis.kwargs["reason"])
    with redis_node(tmp_path / "redis") as node:
        yield node


def test_l2_hits_of_a_large_lookup_are_promoted_in_bounded_batches(tmp_path, redis):
    chunks = [make_chunk(f"many {index}", 2000) for index in range(100)]
    keys = [chunk.key for chunk in chunks]
    with running_daemon(tmp_path / "a", l2=redis.url) as host_a, cache_stub(host_a.address) as stub_a:
        store_chunks(stub_a, chunks)
        assert host_a.cache.drain_writes(10)
    with running_daemon(tmp_path / "b", l2=redis.url, l2_promote_batch=16) as host_b, \
            cache_stub(host_b.address) as stub_b:
        assert lookup(stub_b, keys + [digest("never stored")]).prefix_run == 100
        assert host_b.cache.wait_for_promotions(30)  # the values follow the Lookup in the background
        l2 = stub_b.Stats(cache_pb2.CacheStatsRequest()).l2
        # 100 hits, at most 16 held at once: ceil(100 / 16) = 7 batches, each stored before the next is read.
        assert (l2.hits, l2.misses, l2.promotion_batches) == (100, 1, 7)
        assert [chunk.blob for chunk in fetch_chunks(stub_b, keys)] == [chunk.blob for chunk in chunks]


def test_promoted_l2_hits_are_charged_to_the_tenants_share_not_to_others(tmp_path, redis):
    tokens = {"alice": "alice-token", "bob": "bob-token"}
    tenants = {"alice": {"token": tokens["alice"], "max_bytes": 20_000}, "bob": {"token": tokens["bob"]}}
    (tmp_path / "tenants.json").write_text(json.dumps({"tenants": tenants}))
    (tmp_path / "tenancy.secret").write_text("42" * 32)
    fields = dict(l2=redis.url, tenants_file=tmp_path / "tenants.json", tenancy_secret_file=tmp_path / "tenancy.secret")
    as_alice = {"metadata": (("authorization", f"Bearer {tokens['alice']}"),)}
    as_bob = {"metadata": (("authorization", f"Bearer {tokens['bob']}"),)}
    alices = [make_chunk(f"alice {index}", 4000) for index in range(10)]  # 40 KB: twice her share
    bobs = [make_chunk(f"bob {index}", 4000) for index in range(10)]
    with running_daemon(tmp_path / "a", **fields) as host_a, cache_stub(host_a.address) as stub_a:
        store_chunks(stub_a, alices[:5], **as_alice)
        store_chunks(stub_a, alices[5:], **as_alice)  # her share evicts her own older chunks on A
        assert host_a.cache.drain_writes(10)
    # B's budget holds bob's 40 KB and alice's 20 KB share, no more.
    with running_daemon(tmp_path / "b", max_bytes=60_000, l2_promote_batch=4, **fields) as host_b, \
            cache_stub(host_b.address) as stub_b:
        store_chunks(stub_b, bobs, **as_bob)
        # All ten of alice's chunks are in L2 (reported arriving): promoted four at a time, her share on B keeps
        # five of them ...
        assert lookup(stub_b, [chunk.key for chunk in alices], **as_alice).prefix_run == 10
        assert host_b.cache.wait_for_promotions(30)
        # ... (LMDB's own count: a Lookup would report the rest arriving from L2 again) and every one of bob's
        # chunks survived: alice's promotions evicted within her share only.
        assert stub_b.Stats(cache_pb2.CacheStatsRequest(), **as_alice).entries == 5
        assert stub_b.Stats(cache_pb2.CacheStatsRequest(), **as_bob).entries == 10
        alice_stats = stub_b.Stats(cache_pb2.CacheStatsRequest(), **as_alice)
        assert alice_stats.bytes <= 20_000 and alice_stats.max_bytes == 20_000


def test_a_stalled_redis_does_not_delay_fetch_or_lookup_of_what_lmdb_holds(tmp_path, redis):
    held = [make_chunk(f"in lmdb {index}", 50_000) for index in range(4)]
    num_stuck = 40  # more than asyncio's default pool (min(32, cpus + 4) threads) that every call used to share
    with running_daemon(tmp_path / "a", l2=redis.url, l2_timeout_s=5.0, l2_retry_interval_s=60) as host, \
            cache_stub(host.address) as stub, ThreadPoolExecutor(num_stuck) as callers:
        store_chunks(stub, held)
        assert host.cache.drain_writes(10)
        redis.process.send_signal(signal.SIGSTOP)  # Redis stops answering; its sockets stay open
        try:
            stuck = [callers.submit(lookup, stub, [digest(f"only in L2 {index}")]) for index in range(num_stuck)]
            tier = host.cache.l2
            wait_for(lambda: tier.num_in_flight >= 5, "lookups to wait on the stalled Redis")
            started = time.monotonic()
            # Bounds at half the stall (l2_timeout_s): what waited on Redis would take 5 s; a busy machine, not 2.5.
            fetched = fetch_chunks(stub, [chunk.key for chunk in held], timeout=2.5)
            assert lookup(stub, [chunk.key for chunk in held], timeout=2.5).prefix_run == 4
            elapsed = time.monotonic() - started
            assert [chunk.blob for chunk in fetched] == [chunk.blob for chunk in held]
            assert elapsed < 2.5, f"Fetch and Lookup of LMDB hits took {elapsed:.2f} s behind a stalled Redis"
            assert tier.num_in_flight >= 5, "the stalled lookups were still waiting: the test measured what it says"
        finally:
            redis.process.send_signal(signal.SIGCONT)
        assert all(list(future.result(timeout=30).prefix_hit) == [False] for future in stuck)
