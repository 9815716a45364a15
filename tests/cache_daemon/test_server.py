"""CacheDaemon.stop: new calls are refused with UNAVAILABLE while the calls in flight finish (an in-thread daemon)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvboost.v1 import cache_pb2

from cache_daemon.config import DaemonConfig
from cache_daemon.server import SERVICE_NAME, SHUTTING_DOWN, CacheDaemon
from tests.daemon_support import cache_stub, make_chunk, store_chunks, store_frames

pytestmark = pytest.mark.timeout(120)


@contextmanager
def daemon_on_a_loop(data_dir: Path, shutdown_grace_s: float) -> Iterator[tuple[CacheDaemon, asyncio.AbstractEventLoop]]:
    """(daemon, its loop in a thread); the test stops the daemon itself, this stops it if the test did not."""
    config = DaemonConfig(data_dir=data_dir, listen="127.0.0.1:0", shutdown_grace_s=shutdown_grace_s)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    daemon = asyncio.run_coroutine_threadsafe(CacheDaemon.start(config), loop).result(timeout=30)
    try:
        yield daemon, loop
    finally:
        if not daemon.gate.closed:
            asyncio.run_coroutine_threadsafe(daemon.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


class HeldStore:
    """A Store stream sent halfway, then held open until release(); its reply or error lands in outcome."""

    def __init__(self, address: str, chunks) -> None:
        self.frames = store_frames(chunks)
        self.held, self.released, self.outcome = threading.Event(), threading.Event(), {}
        self.thread = threading.Thread(target=self._store, args=(address,), daemon=True)
        self.thread.start()

    def _frames(self):
        for index, frame in enumerate(self.frames):
            yield frame
            if index == len(self.frames) // 2:
                self.held.set()
                self.released.wait(60)

    def _store(self, address: str) -> None:
        try:
            with cache_stub(address) as stub:
                self.outcome["reply"] = stub.Store(self._frames(), timeout=60)
        except grpc.RpcError as error:
            self.outcome["error"] = error

    def release(self) -> None:
        self.released.set()
        self.thread.join(timeout=60)


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.01)


def refusal_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def test_a_stopping_daemon_refuses_every_new_call_with_unavailable_and_finishes_the_one_in_flight(tmp_path):
    chunks = [make_chunk(f"held {index}", 600_000) for index in range(3)]
    stored_before = make_chunk("stored before the stop")
    with daemon_on_a_loop(tmp_path / "lmdb", shutdown_grace_s=30) as (daemon, loop):
        with cache_stub(daemon.address) as stub:
            store_chunks(stub, [stored_before])
        held = HeldStore(daemon.address, chunks)
        stopping = None
        try:
            assert held.held.wait(30), "the Store stream never opened"
            wait_until(lambda: daemon.in_flight.snapshot() == {"Store": 1}, "the Store handler to run")
            stopping = asyncio.run_coroutine_threadsafe(daemon.stop(), loop)
            wait_until(lambda: daemon.gate.closed, "the stop to close the gate")
            with cache_stub(daemon.address) as stub:
                # Every kind of call (unary, server streaming, client streaming), even for a chunk it holds.
                refusals = [
                    refusal_of(lambda: stub.Lookup(cache_pb2.LookupRequest(
                        namespace=stored_before.namespace, prefix_keys=[stored_before.key]), timeout=10)),
                    refusal_of(lambda: stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10)),
                    refusal_of(lambda: list(stub.Fetch(cache_pb2.FetchRequest(keys=[stored_before.key]), timeout=10))),
                    refusal_of(lambda: stub.Store(iter(store_frames([make_chunk("new")])), timeout=10)),
                ]
                assert [(error.code(), error.details()) for error in refusals] == \
                    [(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)] * 4
            with grpc.insecure_channel(daemon.address) as channel:  # health checks are answered, with the truth
                health = health_pb2_grpc.HealthStub(channel)
                assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING
            assert not stopping.done(), "the daemon stopped with a call in flight"
            held.release()
            assert "error" not in held.outcome, held.outcome.get("error")
            assert held.outcome["reply"].stored == len(chunks)
            stopping.result(timeout=30)
        finally:
            held.release()
            if stopping is not None:
                stopping.result(timeout=60)


def test_a_call_still_in_flight_at_the_end_of_the_grace_does_not_hold_the_stop(tmp_path):
    with daemon_on_a_loop(tmp_path / "lmdb", shutdown_grace_s=0.2) as (daemon, loop):
        held = HeldStore(daemon.address, [make_chunk("never finished", 600_000)])
        try:
            assert held.held.wait(30), "the Store stream never opened"
            wait_until(lambda: daemon.in_flight.snapshot() == {"Store": 1}, "the Store handler to run")
            asyncio.run_coroutine_threadsafe(daemon.stop(), loop).result(timeout=30)
        finally:
            held.release()
        assert "reply" not in held.outcome, "a call cut off by the stop was acknowledged"


def test_a_daemon_without_l2_loads_no_redis_client():
    # redis-py is a tenth of the daemon's start-up; it is imported when an L2 tier first connects.
    probe = "import sys, cache_daemon.__main__\nprint(sorted({name.split('.')[0] for name in sys.modules} & {'redis'}))\n"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
