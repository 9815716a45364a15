"""Real daemon, real services: forged K/V under alice's keys poisons her output on a daemon without tenants,
and changes nothing on a daemon with them; her generations stay token-identical to model.generate."""
from __future__ import annotations

import struct
import zlib

import grpc
import lmdb
import numpy as np
import pytest
from kvboost.v1 import cache_pb2, cache_pb2_grpc
from kvboost.v1 import inference_pb2 as pb

from cache_daemon.store import decode_entry
from inference_service.kv.codec import HEADER_SIZE
from tests.conftest import pick_free_port
from tests.daemon_support import SampleChunk, cache_stub, fetch_chunks, store_chunks
from tests.e2e.daemon_process import start_daemon
from tests.e2e.service_process import generate, running_service
from tests.e2e.stack_process import reference_ids, save_tiny_model
from tests.e2e.tenancy_support import as_tenant, metric_value, scrape, write_tenants_file, write_token_file

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# Byte-level tiny tokenizer: one token per character; 8-token chunks.
DOCUMENT = "The vault code is kept by the harbour master and changes every Monday at dawn. " * 2
QUESTION = " Q: who keeps the vault code?"
MAX_NEW_TOKENS = 8
SERVICE_FLAGS = ("--chunk-size", "8")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")




def stored_chunks(data_dir) -> list[SampleChunk]:
    """Every chunk of a daemon without tenants, read from its LMDB: the keys exactly as a service sends them."""
    environment = lmdb.open(str(data_dir), max_dbs=8, subdir=True, readonly=True, lock=False)
    try:
        meta_db, blobs_db = environment.open_db(b"meta", create=False), environment.open_db(b"blobs", create=False)
        with environment.begin() as txn:
            chunks = []
            for key, value in txn.cursor(db=meta_db):
                entry = decode_entry(bytes(value))
                chunks.append(SampleChunk(key=bytes(key), blob=bytes(txn.get(key, db=blobs_db)),
                                          namespace=entry.namespace, content_key=entry.content_key,
                                          num_tokens=entry.num_tokens))
            return chunks
    finally:
        environment.close()


def forged(chunks: list[SampleChunk]) -> list[SampleChunk]:
    """The same keys with attacker K/V that pass every check: each full chunk keeps its blob header
    (position, shape), gets large random values and the codec's own checksum recomputed, and the
    daemon's CRC-32 is computed by the Store frames. Only the key space keeps them out."""
    forgeries = []
    for index, chunk in enumerate(sorted(chunks, key=lambda chunk: chunk.key)):
        payload = np.random.default_rng(index).normal(0, 30, (len(chunk.blob) - HEADER_SIZE) // 4).astype("<f4")
        blob = bytearray(chunk.blob[:HEADER_SIZE] + payload.tobytes())
        checksum = zlib.crc32(blob[HEADER_SIZE:], zlib.crc32(blob[:HEADER_SIZE - 4]))
        struct.pack_into("<I", blob, HEADER_SIZE - 4, checksum)
        forgeries.append(SampleChunk(key=chunk.key, blob=bytes(blob), namespace=chunk.namespace,
                                     content_key=chunk.content_key, num_tokens=chunk.num_tokens))
    return forgeries


def test_forged_chunks_poison_a_daemon_without_tenants_but_not_one_with_them(tmp_path, tiny_model_dir) -> None:
    prompt = DOCUMENT + QUESTION
    expected = reference_ids(tiny_model_dir, prompt, MAX_NEW_TOKENS)

    # 1. Control: on a daemon with one trusted caller, forged bytes under the service's keys poison it.
    plain_dir = tmp_path / "plain"
    plain = start_daemon(plain_dir, pick_free_port())
    try:
        # --l0-bytes 0: the forged blobs are what the daemon serves; L0 would serve this service's own copies.
        with running_service(str(tiny_model_dir), plain.address, pick_free_port(), tmp_path / "plain-service.log",
                             *SERVICE_FLAGS, "--cache-local-read", "off", "--l0-bytes", "0") as service, \
                service.stub() as stub:
            stub.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
            honest = stored_chunks(plain_dir)
            forgeries = forged(honest)
            with cache_stub(plain.address) as cache:
                cache.Delete(cache_pb2.DeleteRequest(keys=[chunk.key for chunk in forgeries]), timeout=5)
                assert store_chunks(cache, forgeries, timeout=10).stored == len(forgeries)
            _, poisoned = generate(stub, prompt, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
        assert poisoned.cached_tokens > 0
        assert list(poisoned.output_token_ids) != expected, "the forgery must be able to change the output"
    finally:
        plain.terminate()

    # 2. With tenants: bob forges the same keys before and after alice warms, reads, deletes and pins them.
    metrics_port = pick_free_port()
    daemon = start_daemon(tmp_path / "tenants", pick_free_port(), "--tenants-file", str(write_tenants_file(tmp_path)),
                          "--metrics-port", str(metrics_port))
    bob = as_tenant("bob")
    keys = [chunk.key for chunk in honest]
    namespace = honest[0].namespace
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            cache = cache_pb2_grpc.CacheServiceStub(channel)
            assert store_chunks(cache, forgeries, metadata=bob, timeout=10).stored == len(forgeries)
            with running_service(str(tiny_model_dir), daemon.address, pick_free_port(), tmp_path / "alice.log",
                                 *SERVICE_FLAGS, "--cache-local-read", "auto", "--l0-bytes", "0", "--cache-auth-token-file",
                                 str(write_token_file(tmp_path, "alice"))) as service, service.stub() as stub:
                warmed = stub.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
                assert warmed.chunks_stored == len(honest), "bob's forgeries did not take alice's places"
                reply = store_chunks(cache, forgeries, metadata=bob, timeout=10)
                assert (reply.stored, reply.already_present) == (0, len(forgeries))  # his own copies
                _, first = generate(stub, prompt, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
                # Bob reads his forgeries back, never alice's bytes; then deletes by keys and namespace, pins.
                fetched = fetch_chunks(cache, [chunk.key for chunk in forgeries], metadata=bob, timeout=10)
                assert [chunk.blob for chunk in fetched] == [chunk.blob for chunk in forgeries]
                assert cache.Delete(cache_pb2.DeleteRequest(keys=keys), metadata=bob, timeout=5).deleted == len(forgeries)
                with pytest.raises(grpc.RpcError) as no_namespace:
                    cache.Delete(cache_pb2.DeleteRequest(namespace=namespace), metadata=bob, timeout=5)
                assert no_namespace.value.code() == grpc.StatusCode.NOT_FOUND
                with pytest.raises(grpc.RpcError) as no_pin:
                    cache.Pin(cache_pb2.PinRequest(keys=keys), metadata=bob, timeout=5)
                assert no_pin.value.code() == grpc.StatusCode.NOT_FOUND
                _, second = generate(stub, prompt, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
                service_stats = stub.Stats(pb.ServiceStatsRequest(), timeout=5)
        assert "refuses Describe to this token" in service.log(), "co-located reads fell back to the Fetch stream"
        assert not service_stats.degraded, "a refused Describe does not degrade the cache"
        assert first.cached_tokens == warmed.token_count
        assert second.cached_tokens >= warmed.token_count, "the first request's own chunks are reused too"
        for result in (first, second):
            assert not result.degraded
            assert list(result.output_token_ids) == expected, "alice's output is never poisoned"
        metrics = scrape(metrics_port)
        assert metric_value(metrics, "kvboost_cache_refusals_total", reason="permission_denied") >= 1
        # Bob deleted his forgeries: everything left is alice's, her warmed document and her requests' own chunks.
        alice_bytes = metric_value(metrics, "kvboost_cache_tenant_bytes", tenant="alice")
        assert alice_bytes == metric_value(metrics, "kvboost_cache_bytes")
        assert alice_bytes > sum(len(chunk.blob) for chunk in honest)
    finally:
        daemon.terminate()
