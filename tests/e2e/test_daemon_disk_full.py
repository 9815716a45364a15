"""A full disk under --data-dir: a real daemon on a 3 MiB tmpfs refuses the Store that does not fit with
RESOURCE_EXHAUSTED and a message that says what to do, keeps serving what it stored before, and takes the
next Store that fits once the disk has room."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import pytest
from kvboost.v1 import cache_pb2

from tests.conftest import pick_free_port
from tests.daemon_support import cache_stub, fetch_chunks, make_chunk, store_frames
from tests.e2e.daemon_process import start_daemon

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture()
def small_disk(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills) needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_store_that_does_not_fit_the_disk_is_refused_and_what_was_stored_stays(small_disk: Path) -> None:
    daemon = start_daemon(small_disk / "lmdb", pick_free_port())
    try:
        kept = [make_chunk("stored before the disk filled", 200_000)]
        too_big = [make_chunk(f"does not fit {i}", 1_500_000) for i in range(3)]
        with cache_stub(daemon.address) as stub:
            assert stub.Store(iter(store_frames(kept)), timeout=30).stored == 1
            with pytest.raises(grpc.RpcError) as refused:
                stub.Store(iter(store_frames(too_big)), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            assert "bytes free" in refused.value.details() and "--data-dir" in refused.value.details()
            assert "what was stored before is intact" in refused.value.details()
            # Nothing of the refused Store is visible, the earlier chunk reads back whole.
            assert stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10).entries == 1
            assert [got.blob for got in fetch_chunks(stub, [kept[0].key], timeout=10)] == [kept[0].blob]
            lookup = stub.Lookup(cache_pb2.LookupRequest(namespace=too_big[0].namespace,
                                                         prefix_keys=[too_big[0].key]), timeout=10)
            assert lookup.prefix_run == 0
            # A Store that fits is taken (LMDB reuses the pages the failed commit left in its file).
            fits = [make_chunk("fits afterwards", 100_000)]
            assert stub.Store(iter(store_frames(fits)), timeout=30).stored == 1
        assert daemon.process.poll() is None, daemon.log()
        assert "Traceback" not in daemon.log()
    finally:
        assert daemon.terminate() == 0
    # After a restart both chunks it acknowledged are there.
    restarted = start_daemon(small_disk / "lmdb", pick_free_port())
    try:
        with cache_stub(restarted.address) as stub:
            got = fetch_chunks(stub, [kept[0].key, fits[0].key], timeout=10)
        assert [chunk.blob for chunk in got] == [kept[0].blob, fits[0].blob]
    finally:
        assert restarted.terminate() == 0
