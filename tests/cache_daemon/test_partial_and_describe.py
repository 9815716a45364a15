"""Lookup of partial chunks, Describe for co-located readers, and corruption reported by a reader."""
from __future__ import annotations

import signal
import subprocess
import sys
import zlib
from pathlib import Path

import grpc
import pytest
from kvboost.v1 import cache_pb2

from cache_daemon.store import LmdbStore
from tests.cache_daemon.test_cache import NAMESPACE, OTHER_NAMESPACE, cache, clock, open_cache, put  # noqa: F401
from tests.daemon_support import cache_stub, digest, make_chunk, rpc_error, running_daemon, store_chunks


def test_lookup_names_the_first_stored_partial_key_and_counts_it(cache) -> None:
    whole, short, shorter = make_chunk("whole"), make_chunk("partial 5"), make_chunk("partial 3")
    put(cache, whole, short, shorter)
    candidates = [digest("partial 7"), short.key, digest("partial 4"), shorter.key]

    result = cache.lookup(NAMESPACE, [whole.key], [], candidates)

    assert (result.prefix_run, result.partial_index) == (1, 1)  # the longest stored candidate, not the last
    assert cache.stats().num_unflushed_hits == 2  # the run and the partial hit
    assert (cache.stats().counters.hits, cache.stats().counters.misses) == (2, 0)
    assert cache.lookup(NAMESPACE, [], [], [digest("absent")]).partial_index is None
    assert cache.lookup(OTHER_NAMESPACE, [], [], [short.key]).partial_index is None, "another namespace never hits"
    assert cache.stats().counters.misses == 2


def test_keys_reported_corrupt_are_deleted_and_counted(cache) -> None:
    a, b = make_chunk("a", 100), make_chunk("b", 200)
    put(cache, a, b)

    result = cache.delete_keys([a.key, digest("gone already")], corrupted=True)

    assert (result.deleted, cache.stats().counters.corrupted, cache.stats().num_entries) == (1, 1, 1)
    assert cache.delete_keys([b.key]).deleted == 1 and cache.stats().counters.corrupted == 1


def test_the_environment_id_is_created_once_and_kept(tmp_path: Path) -> None:
    first = LmdbStore(tmp_path / "lmdb", map_size=1 << 20)
    environment_id = first.environment_id
    first.close()
    again = LmdbStore(tmp_path / "lmdb", map_size=1 << 20)
    other = LmdbStore(tmp_path / "other", map_size=1 << 20)
    try:
        assert len(environment_id) == 16 and again.environment_id == environment_id
        assert other.environment_id != environment_id
    finally:
        again.close()
        other.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("describe") / "lmdb", max_bytes=1 << 24) as daemon:
        yield daemon


def test_describe_names_the_environment_and_lookup_answers_partial_keys(daemon) -> None:
    stored = make_chunk("partial tail")
    with cache_stub(daemon.address) as stub:
        store_chunks(stub, [stored])
        described = stub.Describe(cache_pb2.DescribeRequest(), timeout=5)
        found = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, partial_keys=[digest("x"), stored.key]),
                            timeout=5)
        none = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, partial_keys=[digest("y")]), timeout=5)
        bad = rpc_error(stub.Lookup, cache_pb2.LookupRequest(namespace=NAMESPACE, partial_keys=[b"short"]), timeout=5)

    assert Path(described.data_dir) == daemon.cache.store.path.resolve()
    assert described.environment_id == daemon.cache.store.environment_id
    assert (described.max_bytes, described.blob_db_version) == (1 << 24, 1) and described.map_size > 0
    assert found.HasField("partial_index") and found.partial_index == 1
    assert not none.HasField("partial_index")
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "partial_keys" in bad.details()


def test_delete_marked_corrupted_counts_and_refuses_a_namespace(daemon) -> None:
    chunk = make_chunk("reported")
    with cache_stub(daemon.address) as stub:
        store_chunks(stub, [chunk])
        before = stub.Stats(cache_pb2.CacheStatsRequest(), timeout=5).corrupted
        reply = stub.Delete(cache_pb2.DeleteRequest(keys=[chunk.key], corrupted=True), timeout=5)
        after = stub.Stats(cache_pb2.CacheStatsRequest(), timeout=5).corrupted
        refused = rpc_error(stub.Delete, cache_pb2.DeleteRequest(namespace=NAMESPACE, corrupted=True), timeout=5)

    assert (reply.deleted, after - before) == (1, 1)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_reader_killed_inside_a_transaction_leaves_a_slot_the_daemon_clears(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path / "lmdb", map_size=1 << 20)
    reader = (
        "import lmdb, sys\n"
        "env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8, create=False)\n"
        "txn = env.begin()\n"
        "print('reading', flush=True)\n"
        "sys.stdin.read()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", reader, str(tmp_path / "lmdb")], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "reading\n"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        assert store.clear_stale_readers() == 1
        assert store.clear_stale_readers() == 0
    finally:
        if process.poll() is None:
            process.kill()
        store.close()


def test_a_reader_that_verifies_gets_the_bytes_and_the_daemon_skips_its_check(tmp_path: Path) -> None:
    cache = open_cache(tmp_path / "lmdb", max_bytes=1 << 20)
    try:
        chunk = make_chunk("flipped", 500)
        put(cache, chunk)
        with cache.store._env.begin(write=True, db=cache.store._blobs) as txn:  # damage the stored bytes
            damaged = bytearray(txn.get(chunk.key))
            damaged[10] ^= 0xFF
            txn.put(chunk.key, bytes(damaged))

        unchecked = cache.read(chunk.key, bytes, verify=False)
        checked = cache.read(chunk.key, bytes)

        assert unchecked is not None and unchecked[1] == bytes(damaged)  # the reader's own check will refuse it
        assert unchecked[0].checksum != zlib.crc32(unchecked[1])
        assert checked is None and cache.stats().counters.corrupted == 1  # the daemon's check deletes it
    finally:
        cache.close()
