"""A service on the daemon's host reads blobs from the daemon's LMDB: reuse, corruption, a killed daemon."""
from __future__ import annotations

import time

import lmdb
import pytest
from kvboost.v1 import cache_pb2
from kvboost.v1 import inference_pb2 as pb

from tests.conftest import pick_free_port
from tests.daemon_support import cache_stub
from tests.e2e.daemon_process import start_daemon
from tests.e2e.service_process import generate, running_service
from tests.e2e.stack_process import reference_ids, save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# Byte-level tiny tokenizer: one token per character. 8-token chunks; the document ends inside a chunk.
DOCUMENT = "Ferries leave the north pier every hour; the last one returns at nine. " * 3
QUESTION = " Q: when is the last ferry?"
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")




def test_a_colocated_service_reads_blobs_from_the_memory_map(tmp_path, tiny_model_dir) -> None:
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port())
    try:
        with running_service(str(tiny_model_dir), daemon.address, pick_free_port(), tmp_path / "service.log",
                             "--chunk-size", "8", "--cache-local-read", "on") as service, service.stub() as stub:
            warmed = stub.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
            _, result = generate(stub, DOCUMENT + QUESTION, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
            with cache_stub(daemon.address) as cache:
                bytes_served_by_fetch = cache.Stats(cache_pb2.CacheStatsRequest(), timeout=5).bytes_read
        assert "read from the daemon's LMDB environment" in service.log()
        assert warmed.partial_tail_tokens > 0
        assert result.cached_tokens == warmed.token_count  # whole chunks and the partial tail
        assert bytes_served_by_fetch == 0, "no blob byte crossed gRPC"
        assert list(result.output_token_ids) == reference_ids(tiny_model_dir, DOCUMENT + QUESTION, MAX_NEW_TOKENS)
    finally:
        daemon.terminate()


def test_a_blob_corrupted_on_disk_is_recomputed_reported_and_deleted(tmp_path, tiny_model_dir) -> None:
    data_dir = tmp_path / "lmdb"
    daemon = start_daemon(data_dir, pick_free_port())
    try:
        # --l0-bytes 0: every hit is read from the daemon's map, where the test damages a blob (L0 keeps copies).
        with running_service(str(tiny_model_dir), daemon.address, pick_free_port(), tmp_path / "service.log",
                             "--chunk-size", "8", "--cache-local-read", "on", "--l0-bytes", "0") as service, \
                service.stub() as stub:
            stub.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
            # A second writer process flips one byte inside every stored blob's payload (LMDB locks writers).
            environment = lmdb.open(str(data_dir), max_dbs=8, subdir=True, create=False)
            try:
                blobs = environment.open_db(b"blobs", create=False)
                with environment.begin(write=True, db=blobs) as txn:
                    for key, blob in list(txn.cursor()):
                        damaged = bytearray(blob)
                        damaged[-1] ^= 0xFF
                        txn.put(key, bytes(damaged))
            finally:
                environment.close()
            _, result = generate(stub, DOCUMENT + QUESTION, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
            with cache_stub(daemon.address) as cache:
                corrupted = cache.Stats(cache_pb2.CacheStatsRequest(), timeout=5).corrupted
        assert result.cached_tokens == 0, "a damaged first chunk ends the reused run"
        assert corrupted == 1, "the service reported the blob it could not decode"
        assert list(result.output_token_ids) == reference_ids(tiny_model_dir, DOCUMENT + QUESTION, MAX_NEW_TOKENS)
    finally:
        daemon.terminate()


def test_a_killed_daemon_leaves_the_service_serving_correctly(tmp_path, tiny_model_dir) -> None:
    data_dir, port = tmp_path / "lmdb", pick_free_port()
    daemon = start_daemon(data_dir, port)
    try:
        with running_service(str(tiny_model_dir), daemon.address, pick_free_port(), tmp_path / "service.log",
                             "--chunk-size", "8", "--cache-timeout", "0.5") as service, service.stub() as stub:
            stub.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
            daemon.kill()  # kill -9 while the service holds the environment open
            _, degraded = generate(stub, DOCUMENT + QUESTION, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
            daemon = start_daemon(data_dir, port)
            deadline = time.monotonic() + 30
            # The service probes the daemon every --cache-timeout and clears `degraded` by itself.
            while stub.Stats(pb.ServiceStatsRequest(), timeout=5).degraded and time.monotonic() < deadline:
                time.sleep(0.1)
            _, after = generate(stub, DOCUMENT + QUESTION, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
        expected = reference_ids(tiny_model_dir, DOCUMENT + QUESTION, MAX_NEW_TOKENS)
        assert degraded.degraded and degraded.cached_tokens == 0
        assert list(degraded.output_token_ids) == expected
        # The restarted daemon serves the same environment: the memory map is read again, nothing was lost.
        assert not after.degraded and after.cached_tokens == len(DOCUMENT)
        assert list(after.output_token_ids) == expected
    finally:
        if daemon.process.poll() is None:
            daemon.terminate()


def test_daemon_and_service_talk_over_a_unix_socket(tmp_path, tiny_model_dir) -> None:
    socket_address = f"unix:{tmp_path / 'daemon.sock'}"
    daemon = start_daemon(tmp_path / "lmdb", socket_address)
    try:
        # --l0-bytes 0: the hits come through the socket's Fetch stream, not from L0's copies.
        with running_service(str(tiny_model_dir), socket_address, pick_free_port(), tmp_path / "service.log",
                             "--chunk-size", "8", "--cache-local-read", "off", "--l0-bytes", "0") as service, \
                service.stub() as stub:
            stub.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
            _, result = generate(stub, DOCUMENT + QUESTION, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
            with cache_stub(socket_address) as cache:
                bytes_served_by_fetch = cache.Stats(cache_pb2.CacheStatsRequest(), timeout=5).bytes_read
        assert result.cached_tokens == len(DOCUMENT) and not result.degraded
        assert bytes_served_by_fetch > 0, "with local reads off, the blobs came through the socket's Fetch stream"
        assert list(result.output_token_ids) == reference_ids(tiny_model_dir, DOCUMENT + QUESTION, MAX_NEW_TOKENS)
    finally:
        daemon.terminate()
