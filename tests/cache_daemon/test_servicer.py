"""CacheService over a real gRPC server in this process: every RPC, its statuses, health, reflection, metrics."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import urllib.request
import zlib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from kvboost.v1 import cache_pb2
from prometheus_client.parser import text_string_to_metric_families

from cache_daemon.config import DaemonConfig
from cache_daemon.errors import StartupError
from cache_daemon.logs import RequestIdFilter
from cache_daemon.server import CacheDaemon
from tests.conftest import pick_free_port
from tests.daemon_support import (NAMESPACE, cache_stub, digest, fetch_chunks, header_frame, hold_key_deletes,
                                  make_chunk, rpc_error, running_daemon, store_chunks, store_frames)

MAX_BYTES = 20_000_000


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("servicer") / "lmdb", max_bytes=MAX_BYTES,
                        metrics_port=pick_free_port()) as daemon:
        yield daemon


@pytest.fixture()
def stub(daemon):
    with cache_stub(daemon.address) as stub:
        yield stub


def test_store_then_fetch_streams_headers_and_1_mib_frames_in_request_order(stub) -> None:
    big, small = make_chunk("big", 2_500_000), make_chunk("small", 10, content_key=digest("c"), pinned=True)
    reply = store_chunks(stub, [big, small])
    assert (reply.stored, reply.already_present, reply.evicted, reply.bytes_stored) == (2, 0, 0, 2_500_010)
    fetched = fetch_chunks(stub, [small.key, digest("absent"), big.key])
    assert [chunk.found for chunk in fetched] == [True, False, True]
    assert fetched[2].blob == big.blob and fetched[2].num_data_frames == 3
    meta = fetched[0].meta
    assert (meta.namespace, meta.content_key, meta.size_bytes, meta.checksum) == \
        (NAMESPACE, small.content_key, 10, zlib.crc32(small.blob))
    assert meta.pinned and meta.frequency == 1.0 and meta.last_access_unix > 0
    assert store_chunks(stub, [big]).already_present == 1


def test_lookup_reports_prefix_run_and_content_hits(stub) -> None:
    first, document = make_chunk("first"), make_chunk("document", content_key=digest("document tokens"))
    store_chunks(stub, [first, document])
    reply = stub.Lookup(cache_pb2.LookupRequest(
        namespace=NAMESPACE, prefix_keys=[first.key, digest("new context"), digest("unknown")],
        content_keys=[b"", document.content_key, digest("unknown tokens")]))
    assert reply.prefix_run == 1 and list(reply.prefix_hit) == [True, False, False]
    assert [(hit.index, hit.stored_key) for hit in reply.content_hits] == [(1, document.key)]


@pytest.mark.parametrize("request_fields, detail", [
    (dict(namespace=b"short"), "LookupRequest.namespace must be 32 bytes"),
    (dict(namespace=NAMESPACE, prefix_keys=[b""]), "must be 32 bytes, got 0"),
    (dict(namespace=NAMESPACE, prefix_keys=[digest(1), b"x" * 31]), "must be 32 bytes, got 31"),
    (dict(namespace=NAMESPACE, prefix_keys=[digest(1)], content_keys=[b"", b""]), "parallel to prefix_keys"),
    (dict(namespace=NAMESPACE, prefix_keys=[digest(1)] * 65537), "more than 65536"),
])
def test_bad_lookups_are_invalid_argument(stub, request_fields, detail: str) -> None:
    error = rpc_error(stub.Lookup, cache_pb2.LookupRequest(**request_fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and detail in error.details()


def test_bad_fetch_keys_are_invalid_argument(stub) -> None:
    error = rpc_error(stub.Fetch, cache_pb2.FetchRequest(keys=[b""]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("frames, code", [
    ([cache_pb2.ChunkFrame(data=b"x")], grpc.StatusCode.INVALID_ARGUMENT),
    ([header_frame(make_chunk("a", 2 << 20)), cache_pb2.ChunkFrame(data=make_chunk("a", 2 << 20).blob)],
     grpc.StatusCode.INVALID_ARGUMENT),
    ([header_frame(make_chunk("a", 10), checksum=1), cache_pb2.ChunkFrame(data=make_chunk("a", 10).blob)],
     grpc.StatusCode.INVALID_ARGUMENT),
    ([header_frame(make_chunk("a", 10), size_bytes=20), cache_pb2.ChunkFrame(data=make_chunk("a", 10).blob)],
     grpc.StatusCode.INVALID_ARGUMENT),
    ([header_frame(make_chunk("a", 10), size_bytes=MAX_BYTES + 1)], grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_bad_store_streams_get_clear_statuses_and_store_nothing(stub, frames, code) -> None:
    entries = stub.Stats(cache_pb2.CacheStatsRequest()).entries
    error = rpc_error(stub.Store, iter(frames))
    assert error.code() == code, error.details()
    assert stub.Stats(cache_pb2.CacheStatsRequest()).entries == entries


def test_stats_count_entries_bytes_and_traffic_per_namespace(stub) -> None:
    namespace = digest("stats namespace")
    chunks = [make_chunk(f"stats {i}", 100, namespace=namespace) for i in range(3)]
    before = stub.Stats(cache_pb2.CacheStatsRequest())
    store_chunks(stub, chunks)
    fetch_chunks(stub, [chunks[0].key, digest("absent")])
    stub.Pin(cache_pb2.PinRequest(keys=[chunks[1].key]))
    after = stub.Stats(cache_pb2.CacheStatsRequest())
    assert (after.entries - before.entries, after.bytes - before.bytes) == (3, 300)
    assert (after.hits - before.hits, after.misses - before.misses) == (1, 1)
    assert (after.bytes_read - before.bytes_read, after.bytes_written - before.bytes_written) == (100, 300)
    assert after.max_bytes == MAX_BYTES and after.map_size >= 2 * MAX_BYTES
    only = stub.Stats(cache_pb2.CacheStatsRequest(namespace=namespace))
    assert [(ns.namespace, ns.entries, ns.bytes, ns.pinned) for ns in only.namespaces] == [(namespace, 3, 300, 1)]


def test_delete_by_keys_and_namespace(stub) -> None:
    namespace = digest("delete namespace")
    chunks = [make_chunk(f"delete {i}", 50, namespace=namespace) for i in range(3)]
    store_chunks(stub, chunks)
    reply = stub.Delete(cache_pb2.DeleteRequest(keys=[chunks[0].key, digest("absent")]))
    assert (reply.deleted, reply.bytes_freed) == (1, 50)
    reply = stub.Delete(cache_pb2.DeleteRequest(namespace=namespace))
    assert (reply.deleted, reply.bytes_freed) == (2, 100)
    assert rpc_error(stub.Delete, cache_pb2.DeleteRequest(namespace=namespace)).code() == grpc.StatusCode.NOT_FOUND
    assert rpc_error(stub.Delete, cache_pb2.DeleteRequest()).code() == grpc.StatusCode.INVALID_ARGUMENT
    both = cache_pb2.DeleteRequest(keys=[digest(1)], namespace=namespace)
    assert rpc_error(stub.Delete, both).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_every_delete_moves_the_lookups_delete_epoch_on_and_eviction_does_not(stub) -> None:
    def epoch() -> tuple[str, int]:
        reply = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[digest("any")]))
        return reply.delete_epoch_id, reply.delete_count

    start_id, start = epoch()
    assert len(start_id) == 16
    evicting = [make_chunk(f"epoch {i}", MAX_BYTES // 3) for i in range(4)]  # more than the budget holds
    assert sum(store_chunks(stub, [chunk]).evicted for chunk in evicting) > 0
    assert epoch() == (start_id, start)  # the budget's evictions are not Deletes
    stub.Delete(cache_pb2.DeleteRequest(keys=[digest("never stored")]))  # found nothing: still a Delete
    assert epoch() == (start_id, start + 1)
    rpc_error(stub.Delete, cache_pb2.DeleteRequest(namespace=digest("an empty namespace")))  # NOT_FOUND: too
    assert epoch() == (start_id, start + 2)
    rpc_error(stub.Delete, cache_pb2.DeleteRequest())  # refused before it named anything: not counted
    assert epoch() == (start_id, start + 2)


def test_a_delete_past_its_deadline_counts_once_its_chunks_are_gone(tmp_path: Path) -> None:
    """gRPC cancels the handler at the deadline, but the removal goes on in its thread: the epoch must not move
    before it ends, or a Lookup in between would confirm a chunk at the epoch that outlives its removal."""
    with running_daemon(tmp_path / "lmdb", max_bytes=MAX_BYTES) as daemon, cache_stub(daemon.address) as stub:
        chunk = make_chunk("deleted slowly")
        store_chunks(stub, [chunk])

        def look() -> tuple[int, int]:
            reply = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[chunk.key]))
            return reply.delete_count, reply.prefix_run

        removing, finish = hold_key_deletes(daemon)
        start, _ = look()
        error = rpc_error(stub.Delete, cache_pb2.DeleteRequest(keys=[chunk.key]), timeout=0.3)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and removing.is_set()
        assert look() == (start, 1)  # still held, still the old epoch
        finish.set()
        deadline = time.monotonic() + 10
        while look()[1] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert look() == (start + 1, 0)  # gone, and counted


def test_pin_and_unpin(stub) -> None:
    chunk = make_chunk("pin me")
    store_chunks(stub, [chunk])
    reply = stub.Pin(cache_pb2.PinRequest(keys=[chunk.key, digest("absent")]))
    assert reply.updated == 1 and list(reply.missing) == [digest("absent")]
    assert fetch_chunks(stub, [chunk.key])[0].meta.pinned
    stub.Unpin(cache_pb2.PinRequest(keys=[chunk.key]))
    assert not fetch_chunks(stub, [chunk.key])[0].meta.pinned
    error = rpc_error(stub.Pin, cache_pb2.PinRequest(keys=[digest("absent")]))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert rpc_error(stub.Unpin, cache_pb2.PinRequest()).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_serving_and_reflection_lists_the_services(daemon) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvboost.v1.CacheService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert {"kvboost.v1.CacheService", "grpc.health.v1.Health"} <= set(services)


def test_prometheus_metrics_are_served(daemon, stub) -> None:
    store_chunks(stub, [make_chunk("metrics")])
    url = f"http://127.0.0.1:{daemon.config.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        families = {family.name: family for family in text_string_to_metric_families(response.read().decode())}
    stats = stub.Stats(cache_pb2.CacheStatsRequest())
    assert families["kvboost_cache_max_bytes"].samples[0].value == MAX_BYTES
    assert families["kvboost_cache_entries"].samples[0].value == stats.entries
    assert families["kvboost_cache_hits"].samples[0].value == stats.hits


def test_calls_in_flight_count_a_running_handler_by_method_until_it_ends(daemon, stub) -> None:
    chunk = make_chunk("held in flight")
    frames = store_frames([chunk])
    sent_first, release = threading.Event(), threading.Event()

    def held():
        yield frames[0]
        sent_first.set()
        release.wait(30)
        yield from frames[1:]

    result: dict = {}
    writer = threading.Thread(target=lambda: result.setdefault("reply", stub.Store(held(), timeout=30)))
    assert daemon.in_flight.snapshot() == {}
    writer.start()
    try:
        assert sent_first.wait(30)
        deadline = time.monotonic() + 30
        while daemon.in_flight.snapshot() != {"Store": 1} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.in_flight.snapshot() == {"Store": 1}
        assert daemon.in_flight.describe() == "1 call in flight (Store 1)"
        url = f"http://127.0.0.1:{daemon.config.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            families = {family.name: family for family in text_string_to_metric_families(response.read().decode())}
        samples = {sample.labels["method"]: sample.value for sample in families["kvboost_cache_calls_in_flight"].samples}
        assert samples == {"Store": 1.0}
    finally:
        release.set()
        writer.join(30)
    assert result["reply"].stored == 1
    assert daemon.in_flight.snapshot() == {} and daemon.in_flight.describe() == "0 calls in flight"


def test_log_lines_carry_the_callers_request_id(stub, caplog) -> None:
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.INFO, logger="cache_daemon"):
        rpc_error(stub.Lookup, cache_pb2.LookupRequest(namespace=b""), metadata=[("x-request-id", "req-42")])
    assert [record.request_id for record in caplog.records if "INVALID_ARGUMENT" in record.getMessage()] == ["req-42"]


def test_a_bearer_token_guards_every_rpc_but_health(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with running_daemon(tmp_path / "lmdb", auth_token_file=token_file) as daemon, cache_stub(daemon.address) as stub:
        stats = cache_pb2.CacheStatsRequest()
        assert rpc_error(stub.Stats, stats).code() == grpc.StatusCode.UNAUTHENTICATED
        wrong = [("authorization", "Bearer nope")]
        assert rpc_error(stub.Stats, stats, metadata=wrong).code() == grpc.StatusCode.UNAUTHENTICATED
        assert rpc_error(stub.Fetch, cache_pb2.FetchRequest(keys=[digest(1)])).code() == \
            grpc.StatusCode.UNAUTHENTICATED
        assert stub.Stats(stats, metadata=[("authorization", "Bearer s3cret")]).max_bytes == 1 << 30
        with grpc.insecure_channel(daemon.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_port_in_use_is_a_startup_error_that_releases_the_data_dir(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = DaemonConfig(data_dir=tmp_path / "lmdb", listen=f"127.0.0.1:{taken.getsockname()[1]}")
        with pytest.raises(StartupError, match="cannot serve on"):
            asyncio.run(CacheDaemon.start(config))
    with running_daemon(tmp_path / "lmdb") as daemon, cache_stub(daemon.address) as stub:
        assert stub.Stats(cache_pb2.CacheStatsRequest()).entries == 0


def test_a_fetch_cancelled_mid_stream_leaves_the_daemon_serving(stub) -> None:
    chunks = [make_chunk(f"cancel {i}", 3_000_000) for i in range(4)]
    store_chunks(stub, chunks)
    call = stub.Fetch(cache_pb2.FetchRequest(keys=[chunk.key for chunk in chunks]))
    assert next(call).header.found
    call.cancel()
    assert [chunk.blob for chunk in fetch_chunks(stub, [chunks[3].key])] == [chunks[3].blob]


def test_the_lmdb_map_grows_past_a_tiny_initial_size(tmp_path: Path) -> None:
    chunk = make_chunk("bigger than the map", 3_000_000)
    with running_daemon(tmp_path / "lmdb", map_size=1 << 20) as daemon, cache_stub(daemon.address) as stub:
        assert store_chunks(stub, [chunk]).stored == 1
        assert stub.Stats(cache_pb2.CacheStatsRequest()).map_size > 3_000_000
        assert fetch_chunks(stub, [chunk.key])[0].blob == chunk.blob
