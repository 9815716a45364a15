"""A real daemon process gives the heap memory of finished Fetches back to the OS (cache_daemon.allocator)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from kvboost.v1 import cache_pb2

from tests.conftest import pick_free_port, wait_for
from tests.daemon_support import cache_stub, fetch_chunks, make_chunk, store_chunks
from tests.e2e.daemon_process import start_daemon

pytestmark = pytest.mark.e2e

CHUNK_BYTES = 4 << 20
NUM_THREADS = 8
FETCHES_PER_THREAD = 6
# Retained free memory after the load, beyond what the daemon held before it. Without trimming the
# daemon keeps ~100 MiB here (freed 1 MiB Fetch frames in per-thread malloc arenas).
MAX_RETAINED_MIB = 24


def rss_anon_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc status")


def fetch_concurrently(address: str, keys: list[bytes]) -> None:
    """NUM_THREADS clients on one channel, each Fetching every key FETCHES_PER_THREAD times."""
    errors: list[BaseException] = []

    def client(stub) -> None:
        try:
            for _ in range(FETCHES_PER_THREAD):
                fetched = fetch_chunks(stub, keys)
                assert all(chunk.found for chunk in fetched), "a stored chunk was not found"
        except BaseException as error:
            errors.append(error)

    with cache_stub(address) as stub:
        threads = [threading.Thread(target=client, args=(stub,)) for _ in range(NUM_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors


def test_heap_freed_by_concurrent_fetches_goes_back_to_the_os(tmp_path) -> None:
    chunks = [make_chunk(f"big {number}", CHUNK_BYTES) for number in range(3)]
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port(), "--heap-trim-interval", "0.2",
                          "--log-level", "WARNING")
    try:
        with cache_stub(daemon.address) as stub:
            store_chunks(stub, chunks)
            fetch_chunks(stub, [chunk.key for chunk in chunks])  # one Fetch warms up code paths and buffers
        time.sleep(0.5)
        before = rss_anon_mib(daemon.process.pid)
        fetch_concurrently(daemon.address, [chunk.key for chunk in chunks])
        # Trimmed within a few trim intervals of the load's end; fails with the RSS it kept otherwise.
        wait_for(lambda: rss_anon_mib(daemon.process.pid) - before < MAX_RETAINED_MIB,
                 f"RssAnon back within {MAX_RETAINED_MIB} MiB of {before:.1f} MiB", timeout_s=5.0)
    finally:
        daemon.terminate()
