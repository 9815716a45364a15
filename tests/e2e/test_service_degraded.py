"""Daemon killed mid-stream: the request completes, later ones run degraded, and hit again once it is back."""
from __future__ import annotations

import time

import pytest

from kvboost.v1 import inference_pb2 as pb
from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.e2e.service_process import generate, running_service
from tests.e2e.stack_process import save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CHUNK_SIZE = 32
# Byte-level tokenizer: 458 tokens, 14 full chunks.
SHARED_TEXT = "The harbour ferry leaves at six and returns at nine; bicycles cost extra. " * 6 + "Tickets: pier."
LONG_GENERATION = 300  # seconds of decoding on CPU: the kill lands mid-stream


def wait_for_stats(stub, condition, timeout_s: float = 15.0) -> pb.ServiceStatsReply:
    deadline = time.monotonic() + timeout_s
    while not condition(stats := stub.Stats(pb.ServiceStatsRequest(), timeout=5)):
        assert time.monotonic() < deadline, f"Stats never met the condition; last: {stats}"
        time.sleep(0.05)
    return stats


def test_daemon_killed_mid_stream_then_restarted(tmp_path) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    daemon_port = pick_free_port()
    daemon_addr = f"127.0.0.1:{daemon_port}"
    daemon = start_daemon(tmp_path / "lmdb", daemon_port)
    try:
        with running_service(str(model_dir), daemon_addr, pick_free_port(), tmp_path / "service.log",
                             "--chunk-size", str(CHUNK_SIZE), "--cache-timeout", "0.5") as service, service.stub() as stub:
            warmed = stub.Warm(pb.WarmRequest(text=SHARED_TEXT), timeout=60)
            assert warmed.chunks_stored == len(SHARED_TEXT) // CHUNK_SIZE + 1  # and the tail as a partial chunk

            # Kill the daemon while the answer streams: decoding needs no cache, so the request completes.
            stream = stub.Generate(pb.GenerateRequest(prompt=SHARED_TEXT + " Q?", max_new_tokens=LONG_GENERATION,
                                                      mode=pb.PREFIX_CACHE), timeout=60)
            first = next(stream)
            daemon.kill()
            rest = list(stream)
            result = rest[-1].result
            assert first.token_ids and rest[-1].HasField("result")
            assert result.cached_tokens == len(SHARED_TEXT)  # its lookup ran before the kill
            assert result.generated_tokens == len(first.token_ids) + sum(len(e.token_ids) for e in rest)

            # With the daemon gone the next request runs without the cache and says so. Promptly: the dead daemon
            # is noticed by a refused connection (UNAVAILABLE), not by waiting out a deadline, and only once;
            # while degraded, calls fail before any network round trip (test_grpc_store.py checks that part).
            _, degraded = generate(stub, SHARED_TEXT + " Q?", max_new_tokens=4, mode=pb.PREFIX_CACHE)
            assert degraded.degraded and degraded.cached_tokens == 0 and degraded.generated_tokens == 4
            assert stub.Stats(pb.ServiceStatsRequest(), timeout=5).degraded
            noticed = [line for line in service.log().splitlines() if f"cache daemon at {daemon_addr} unreachable" in line]
            assert len(noticed) == 1 and "UNAVAILABLE" in noticed[0], service.log()
            assert "DEADLINE_EXCEEDED" not in service.log()

            # The daemon comes back on its port with its data: the service reconnects by itself and hits.
            daemon = start_daemon(tmp_path / "lmdb", daemon_port)
            wait_for_stats(stub, lambda stats: not stats.degraded)
            _, again = generate(stub, SHARED_TEXT + " Q?", max_new_tokens=4, mode=pb.PREFIX_CACHE)
            assert not again.degraded
            assert again.cached_tokens == len(SHARED_TEXT)
            assert list(again.output_token_ids) == list(degraded.output_token_ids)
    finally:
        if daemon.process.poll() is None:
            daemon.terminate()
