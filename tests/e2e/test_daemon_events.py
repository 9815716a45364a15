"""KV events across a real daemon's restart: the incarnation changes and a consumer resyncs to what LMDB kept."""
from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from kvboost.v1 import cache_pb2

from tests.conftest import pick_free_port
from tests.daemon_support import NAMESPACE, cache_stub, make_chunk, store_chunks
from tests.e2e.daemon_process import DaemonProcess, start_daemon
from tests.event_support import EventStream, KeyView

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def stop(daemon: DaemonProcess, how: str) -> None:
    assert (daemon.terminate() if how == "sigterm" else daemon.kill()) == (0 if how == "sigterm" else -9)


@pytest.mark.parametrize("how", ["sigterm", "kill -9"])
def test_after_a_restart_the_incarnation_differs_and_the_consumer_resyncs_to_the_persisted_keys(
        tmp_path: Path, how: str) -> None:
    data_dir = tmp_path / "lmdb"
    chunks = [make_chunk(f"persisted {index}", 2000) for index in range(12)]
    # --shutdown-grace 60: the stop below must not be waiting on the open watch.
    daemon = start_daemon(data_dir, pick_free_port(), "--shutdown-grace", "60")
    try:
        with cache_stub(daemon.address) as stub:
            stream = EventStream(stub, cache_pb2.WatchEventsRequest()).start_reading()
            stream.synced()
            store_chunks(stub, chunks[:8])
            stub.Delete(cache_pb2.DeleteRequest(keys=[chunks[0].key]))
            before = stream.until(lambda view: len(view.events) == 9)
            started = time.monotonic()
            stop(daemon, how)
            assert stream.ended.wait(30)
            if how == "sigterm":
                assert time.monotonic() - started < 30 and stream.error is None, "the watch ended cleanly, at once"
            else:
                assert stream.error.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if daemon.process.poll() is None:
            daemon.kill()
    daemon = start_daemon(data_dir, pick_free_port())
    try:
        with cache_stub(daemon.address) as stub:
            store_chunks(stub, chunks[8:])  # before the consumer is back: only the snapshot can tell it
            resumed = KeyView(held=set(before.held), incarnation=before.incarnation,
                              next_sequence=before.next_sequence)
            request = cache_pb2.WatchEventsRequest(incarnation=before.incarnation, from_sequence=before.next_sequence)
            stream = EventStream(stub, request, view=resumed).start_reading()
            try:
                view = stream.until(lambda view: view.lost_reasons and view.in_sync)
                assert view.lost_reasons == ["new incarnation"] and view.incarnation != before.incarnation
                assert view.held == {("", NAMESPACE, chunk.key) for chunk in chunks[1:]}
                assert view.next_sequence == 4, "the new incarnation numbers from 0: 4 chunks stored so far"
                store_chunks(stub, [chunks[0]])
                assert stream.until(lambda view: len(view.events) == 1).events[0].sequence == 4
                assert view.held == {("", NAMESPACE, chunk.key) for chunk in chunks}
            finally:
                stream.close()
    finally:
        daemon.terminate()
