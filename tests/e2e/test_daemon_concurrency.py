"""8 clients store and fetch at once against a real daemon under a tight budget."""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import lmdb
import pytest
from kvboost.v1 import cache_pb2

from cache_daemon.store import BLOBS_DB, META_DB
from tests.conftest import pick_free_port
from tests.daemon_support import NAMESPACE, cache_stub, fetch_chunks, make_chunk, store_chunks
from tests.e2e.daemon_process import start_daemon

pytestmark = pytest.mark.e2e

MAX_BYTES = 3_000_000
NUM_CLIENTS = 8
RUN_SECONDS = 4.0
# 120 distinct chunks of 20-300 KB (~19 MB): about six times the budget, so eviction never rests.
POOL = [make_chunk(f"pool {index}", size)
        for index, size in enumerate(random.Random(3).choices(range(20_000, 300_000), k=120))]


def client(address: str, seed: int, deadline: float, counts: dict, errors: list) -> None:
    rng = random.Random(seed)
    try:
        with cache_stub(address) as stub:
            while time.monotonic() < deadline:
                batch = rng.sample(POOL, rng.randint(1, 4))
                reply = store_chunks(stub, batch)
                assert reply.stored + reply.already_present == len(batch)
                keys = [chunk.key for chunk in rng.sample(POOL, rng.randint(1, 6))]
                # fetch_chunks checks stream order, frame sizes, lengths and every checksum.
                for fetched in fetch_chunks(stub, keys):
                    if fetched.found:
                        assert fetched.blob == next(c.blob for c in POOL if c.key == fetched.meta.key)
                        counts["found"] += 1
                stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys))
                counts["rounds"] += 1
    except BaseException as error:  # reported by the test thread
        errors.append(error)


def watch_budget(address: str, stop: threading.Event, samples: list) -> None:
    with cache_stub(address) as stub:
        while not stop.is_set():
            samples.append(stub.Stats(cache_pb2.CacheStatsRequest()).bytes)


def lmdb_totals(data_dir: Path) -> tuple[int, int, int]:
    """(blob bytes, blobs, metadata records) as stored in the LMDB file."""
    with lmdb.open(str(data_dir), max_dbs=3, readonly=True, lock=False) as env:
        blobs, meta = env.open_db(BLOBS_DB, create=False), env.open_db(META_DB, create=False)
        with env.begin() as txn:
            sizes = [len(value) for _, value in txn.cursor(db=blobs)]
            return sum(sizes), len(sizes), txn.stat(meta)["entries"]


def test_concurrent_clients_see_no_errors_and_the_budget_holds(tmp_path: Path) -> None:
    data_dir = tmp_path / "lmdb"
    daemon = start_daemon(data_dir, pick_free_port(), "--max-bytes", str(MAX_BYTES), "--flush-interval", "0.1")
    counts = {"rounds": 0, "found": 0}
    errors: list[BaseException] = []
    samples: list[int] = []
    stop_watching = threading.Event()
    try:
        deadline = time.monotonic() + RUN_SECONDS
        threads = [threading.Thread(target=client, args=(daemon.address, seed, deadline, counts, errors))
                   for seed in range(NUM_CLIENTS)]
        watcher = threading.Thread(target=watch_budget, args=(daemon.address, stop_watching, samples))
        for thread in [*threads, watcher]:
            thread.start()
        for thread in threads:
            thread.join()
        stop_watching.set()
        watcher.join()
        with cache_stub(daemon.address) as stub:
            stats = stub.Stats(cache_pb2.CacheStatsRequest())
    finally:
        assert daemon.terminate() == 0
    assert not errors, f"{len(errors)} client errors, the first: {errors[0]!r}"
    assert counts["rounds"] >= NUM_CLIENTS and counts["found"] > 0
    assert samples and max(samples) <= MAX_BYTES, f"Stats reported {max(samples)} bytes"
    assert stats.evictions > 0 and stats.corrupted == 0
    blob_bytes, num_blobs, num_meta = lmdb_totals(data_dir)
    assert blob_bytes <= MAX_BYTES and (num_blobs, num_meta, blob_bytes) == (stats.entries, stats.entries, stats.bytes)
    # Freed pages are reused: the file stays within a small multiple of the budget.
    file_bytes = (data_dir / "data.mdb").stat().st_size
    assert file_bytes <= 4 * MAX_BYTES, f"data.mdb grew to {file_bytes} bytes for a {MAX_BYTES}-byte budget"
