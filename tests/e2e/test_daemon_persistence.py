"""A real daemon process keeps every committed chunk and its frequency across kill -9 and SIGTERM."""
from __future__ import annotations

import random
from pathlib import Path

import lmdb
import pytest
from kvboost.v1 import cache_pb2

from cache_daemon.store import BLOBS_DB
from tests.conftest import pick_free_port, wait_for
from tests.daemon_support import NAMESPACE, cache_stub, fetch_chunks, make_chunk, store_chunks
from tests.e2e.daemon_process import start_daemon

pytestmark = pytest.mark.e2e

NUM_CHUNKS = 50


def make_chunks() -> list:
    sizes = random.Random(7).choices(range(1_000, 120_000), k=NUM_CHUNKS)
    return [make_chunk(f"persisted {index}", size) for index, size in enumerate(sizes)]


def look_up(address: str, chunks) -> list[float]:
    """Chunk i is looked up i % 4 times; returns the frequencies that should result (no decay)."""
    with cache_stub(address) as stub:
        for index, chunk in enumerate(chunks):
            for _ in range(index % 4):
                stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[chunk.key]))
    return [1.0 + index % 4 for index in range(len(chunks))]


def fetch_state(address: str, chunks) -> list[tuple[bytes, cache_pb2.ChunkMeta]]:
    with cache_stub(address) as stub:
        fetched = fetch_chunks(stub, [chunk.key for chunk in chunks])
    assert all(chunk.found for chunk in fetched), "a committed chunk is missing"
    return [(chunk.blob, chunk.meta) for chunk in fetched]


def store_in_batches(address: str, chunks, batch: int = 10) -> None:
    with cache_stub(address) as stub:
        for start in range(0, len(chunks), batch):
            assert store_chunks(stub, chunks[start:start + batch]).stored == len(chunks[start:start + batch])


def test_kill_9_keeps_every_committed_chunk_and_flushed_frequency(tmp_path: Path) -> None:
    data_dir, chunks = tmp_path / "lmdb", make_chunks()
    daemon = start_daemon(data_dir, pick_free_port(), "--half-life", "0", "--flush-interval", "0.05")
    try:
        store_in_batches(daemon.address, chunks)
        expected = look_up(daemon.address, chunks)
        # Frequencies are written behind: wait until Fetch (which reports them) shows them all.
        before = wait_for(lambda: (state := fetch_state(daemon.address, chunks))
                          and [meta.frequency for _, meta in state] == expected and state)
    finally:
        assert daemon.kill() == -9
    daemon = start_daemon(data_dir, pick_free_port())
    try:
        after = fetch_state(daemon.address, chunks)
    finally:
        daemon.terminate()
    assert [blob for blob, _ in after] == [chunk.blob for chunk in chunks], "blobs are bit-exact"
    assert [meta for _, meta in after] == [meta for _, meta in before], "metadata, frequencies included"


def test_sigterm_flushes_pending_hits_and_keeps_everything(tmp_path: Path) -> None:
    data_dir, chunks = tmp_path / "lmdb", make_chunks()
    # No periodic flush during the test: only the shutdown flush can persist the hits.
    daemon = start_daemon(data_dir, pick_free_port(), "--half-life", "0", "--flush-interval", "3600")
    try:
        store_in_batches(daemon.address, chunks)
        expected = look_up(daemon.address, chunks)
        assert [meta.frequency for _, meta in fetch_state(daemon.address, chunks)] == [1.0] * NUM_CHUNKS
    finally:
        assert daemon.terminate() == 0
    assert "frequencies flushed and LMDB synced" in daemon.log()
    daemon = start_daemon(data_dir, pick_free_port())
    try:
        after = fetch_state(daemon.address, chunks)
    finally:
        daemon.terminate()
    assert [blob for blob, _ in after] == [chunk.blob for chunk in chunks]
    assert [meta.frequency for _, meta in after] == expected


def test_a_byte_flipped_in_lmdb_is_detected_and_served_as_a_miss(tmp_path: Path) -> None:
    data_dir = tmp_path / "lmdb"
    good, bad = make_chunk("good", 50_000), make_chunk("bad", 50_000)
    daemon = start_daemon(data_dir, pick_free_port())
    try:
        with cache_stub(daemon.address) as stub:
            store_chunks(stub, [good, bad])
    finally:
        daemon.terminate()
    with lmdb.open(str(data_dir), max_dbs=3) as env:
        blobs = env.open_db(BLOBS_DB)
        with env.begin(write=True, db=blobs) as txn:
            blob = bytearray(txn.get(bad.key))
            blob[12_345] ^= 0x01
            txn.put(bad.key, bytes(blob))
    daemon = start_daemon(data_dir, pick_free_port())
    try:
        with cache_stub(daemon.address) as stub:
            fetched = fetch_chunks(stub, [bad.key, good.key])
            assert [chunk.found for chunk in fetched] == [False, True]
            assert fetched[1].blob == good.blob
            stats = stub.Stats(cache_pb2.CacheStatsRequest())
            assert (stats.corrupted, stats.entries) == (1, 1)
            lookup = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[bad.key, good.key]))
            assert list(lookup.prefix_hit) == [False, True]
    finally:
        daemon.terminate()
    assert "failed its CRC-32 check" in daemon.log()


def test_a_second_daemon_on_the_same_dir_refuses_to_start(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port())
    try:
        with pytest.raises(RuntimeError, match="in use by another cache daemon"):
            start_daemon(tmp_path / "lmdb", pick_free_port())
        with cache_stub(daemon.address) as stub:
            assert stub.Stats(cache_pb2.CacheStatsRequest()).entries == 0
    finally:
        daemon.terminate()
