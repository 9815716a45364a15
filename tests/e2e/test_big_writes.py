"""A Warm larger than the daemon takes in one Store stream (--max-store-bytes) goes out as bounded streams
(--cache-max-stream-bytes) and succeeds: every chunk is stored, the daemon stays in use, and a later request
reuses the whole text exactly. Before, the one stream was refused and the write-back lost."""
from __future__ import annotations

import grpc
import pytest
from kvboost.v1 import cache_pb2, cache_pb2_grpc
from kvboost.v1 import inference_pb2 as pb

from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.e2e.service_process import generate, running_service
from tests.e2e.stack_process import reference_ids, save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CHUNK_SIZE = 128
NUM_TOKENS = 3840  # byte tokenizer: 30 chunks of 128 tokens x 512 B of K/V a token = ~1.9 MiB of blobs
TEXT = ("Harbour log: the ferry left at six, the wind was west, the gate was two. " * 60)[:NUM_TOKENS]


def daemon_entries(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.CacheStatsRequest(), timeout=10).entries


def test_a_warm_larger_than_one_store_stream_succeeds_in_bounded_streams(tmp_path) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    daemon_port = pick_free_port()
    # The daemon refuses Store streams over 1.5 MiB; the service sends streams of at most 1 MiB.
    daemon = start_daemon(tmp_path / "lmdb", daemon_port, "--max-store-bytes", "1572864")
    try:
        with running_service(str(model_dir), f"127.0.0.1:{daemon_port}", pick_free_port(), tmp_path / "service.log",
                             "--chunk-size", str(CHUNK_SIZE), "--cache-max-stream-bytes", str(1 << 20),
                             "--l0-bytes", "0") as service, service.stub() as stub:
            warmed = stub.Warm(pb.WarmRequest(text=TEXT), timeout=120)
            assert (warmed.chunks_stored, warmed.token_count) == (NUM_TOKENS // CHUNK_SIZE, NUM_TOKENS)
            assert daemon_entries(f"127.0.0.1:{daemon_port}") == NUM_TOKENS // CHUNK_SIZE
            prompt = TEXT + " And the next?"
            _, result = generate(stub, prompt, max_new_tokens=6, mode=pb.PREFIX_CACHE)
            assert not result.degraded and result.cached_tokens == NUM_TOKENS
            assert list(result.output_token_ids) == reference_ids(model_dir, prompt, 6)
        assert "RESOURCE_EXHAUSTED" not in service.log() and "unreachable" not in service.log()
    finally:
        daemon.terminate()
