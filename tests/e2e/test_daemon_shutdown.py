"""SIGTERM lets in-flight calls finish: a real daemon process, a Store stream held open across the signal."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from kvboost.v1 import cache_pb2

from cache_daemon.server import SHUTTING_DOWN
from tests.conftest import pick_free_port
from tests.daemon_support import cache_stub, fetch_chunks, make_chunk, store_frames
from tests.e2e.daemon_process import start_daemon
from tests.e2e.tenancy_support import scrape

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_sigterm_lets_an_in_flight_store_finish_and_refuses_new_calls(tmp_path: Path) -> None:
    data_dir = tmp_path / "lmdb"
    metrics_port = pick_free_port()
    daemon = start_daemon(data_dir, pick_free_port(), "--shutdown-grace", "30", "--metrics-port", str(metrics_port))
    chunks = [make_chunk(f"in flight {i}", 1_500_000) for i in range(3)]
    frames = store_frames(chunks)
    held, release = threading.Event(), threading.Event()
    outcome: dict = {}

    def held_frames():
        for index, frame in enumerate(frames):
            yield frame
            if index == len(frames) // 2:  # part of the call sent: hold it open across the SIGTERM
                held.set()
                if not release.wait(60):
                    raise AssertionError("the test never released the stream")

    def store() -> None:
        try:
            with cache_stub(daemon.address) as stub:
                outcome["reply"] = stub.Store(held_frames(), timeout=60)
        except BaseException as error:  # asserted below
            outcome["error"] = error

    writer = threading.Thread(target=store, daemon=True)
    try:
        writer.start()
        assert held.wait(30), "the Store stream never opened"
        # The client having sent frames does not mean the daemon's handler runs: the transport buffers them,
        # and a call no handler has taken yet is cancelled by gRPC at shutdown (grpc/grpc#41785). Wait until
        # the daemon counts the Store in flight.
        deadline = time.monotonic() + 30
        while 'kvboost_cache_calls_in_flight{method="Store"} 1.0' not in scrape(metrics_port):
            assert time.monotonic() < deadline, scrape(metrics_port)
            time.sleep(0.05)
        daemon.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "shutdown requested: 1 call in flight (Store 1)" not in daemon.log():
            assert time.monotonic() < deadline and daemon.process.poll() is None, daemon.log()
            time.sleep(0.05)
        # Shutting down, the daemon takes no new calls...
        with cache_stub(daemon.address) as stub, pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(cache_pb2.LookupRequest(namespace=chunks[0].namespace, prefix_keys=[chunks[0].key]), timeout=5)
        # Refused by the daemon itself, as a client retries elsewhere: it keeps listening until the call in flight is
        # done, so a new call meets its refusal rather than gRPC's stop (which could answer CANCELLED).
        assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        assert daemon.process.poll() is None, "the daemon exited with a call in flight"
        # ...but the one in flight finishes and is acknowledged.
        release.set()
        writer.join(timeout=60)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["reply"].stored == len(chunks)
        assert daemon.process.wait(timeout=30) == 0, daemon.log()
    finally:
        release.set()
        if daemon.process.poll() is None:
            daemon.kill()
    # What it acknowledged was synced before it exited.
    restarted = start_daemon(data_dir, pick_free_port())
    try:
        with cache_stub(restarted.address) as stub:
            fetched = fetch_chunks(stub, [chunk.key for chunk in chunks], timeout=30)
        assert [got.blob for got in fetched] == [chunk.blob for chunk in chunks]
    finally:
        assert restarted.terminate() == 0
