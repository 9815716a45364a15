"""Tenant isolation on one daemon: two services with different --tenant-salt never hit each other's chunks;
Delete of one tenant's namespace leaves the other's entries."""
from __future__ import annotations

import time

import grpc
import pytest
from kvboost.v1 import cache_pb2, cache_pb2_grpc
from kvboost.v1 import inference_pb2 as pb

from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.e2e.service_process import generate, running_service
from tests.e2e.stack_process import save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CHUNK_SIZE = 32
# Byte-level tokenizer: one token per character, so 8 full chunks.
PROMPT = "Tenant report: the quarterly numbers stay private to each team. " * 4
FULL_CHUNKS = len(PROMPT) // CHUNK_SIZE
QUESTION = "Who may read it?"  # < 32 tokens: the prompt with it still has FULL_CHUNKS full chunks


def namespace_stats(daemon_addr: str) -> dict[bytes, cache_pb2.NamespaceStats]:
    with grpc.insecure_channel(daemon_addr) as channel:
        stats = cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.CacheStatsRequest(), timeout=10)
    return {entry.namespace: entry for entry in stats.namespaces}


def wait_for_entries(daemon_addr: str, namespace: bytes, entries: int, timeout_s: float = 20.0) -> None:
    """Write-back runs in the background: poll the daemon's Stats until the namespace holds `entries`."""
    deadline = time.monotonic() + timeout_s
    while (found := namespace_stats(daemon_addr).get(namespace)) is None or found.entries < entries:
        assert time.monotonic() < deadline, f"namespace {namespace.hex()[:16]} never reached {entries} entries"
        time.sleep(0.05)


def test_two_tenants_with_the_same_prompt_never_share_chunks(tmp_path) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    daemon_port = pick_free_port()
    daemon_addr = f"127.0.0.1:{daemon_port}"
    daemon = start_daemon(tmp_path / "lmdb", daemon_port)
    try:
        def tenant(salt: str):
            return running_service(str(model_dir), daemon_addr, pick_free_port(), tmp_path / f"service-{salt}.log",
                                   "--chunk-size", str(CHUNK_SIZE), "--tenant-salt", salt)

        with tenant("alpha") as alpha, tenant("beta") as beta, alpha.stub() as stub_a, beta.stub() as stub_b:
            ns_a = bytes.fromhex(stub_a.ModelInfo(pb.ModelInfoRequest(), timeout=10).namespace_hex)
            ns_b = bytes.fromhex(stub_b.ModelInfo(pb.ModelInfoRequest(), timeout=10).namespace_hex)
            assert len(ns_a) == len(ns_b) == 32 and ns_a != ns_b, "the tenant salt must change the namespace"

            assert stub_a.Warm(pb.WarmRequest(text=PROMPT), timeout=60).chunks_stored == FULL_CHUNKS
            wait_for_entries(daemon_addr, ns_a, FULL_CHUNKS)
            assert ns_b not in namespace_stats(daemon_addr)

            # Tenant A hits its own chunks; tenant B, with the very same prompt, hits nothing, not even by
            # content (CHUNK_KV_REUSE looks up prefix and content keys). One call only: its own write-back
            # would make a second call hit B's own chunks.
            _, hit_a = generate(stub_a, PROMPT + QUESTION, max_new_tokens=2, mode=pb.PREFIX_CACHE)
            assert hit_a.cached_tokens == FULL_CHUNKS * CHUNK_SIZE
            # Each request's write-back stores its tail (the question) as a partial chunk: one more entry.
            _, miss_b = generate(stub_b, PROMPT + QUESTION, max_new_tokens=2, mode=pb.CHUNK_KV_REUSE)
            assert miss_b.cached_tokens == 0, "tenant beta reused alpha's chunks"
            assert not miss_b.degraded

            # B's own write-back lands in B's namespace only. Each request also stores its answer with its tail
            # (one more partial chunk: the question and the answer's first token), so each has two more entries.
            wait_for_entries(daemon_addr, ns_b, FULL_CHUNKS + 2)
            wait_for_entries(daemon_addr, ns_a, FULL_CHUNKS + 2)
            namespaces = namespace_stats(daemon_addr)
            assert namespaces[ns_a].entries == FULL_CHUNKS + 2
            assert namespaces[ns_b].entries == FULL_CHUNKS + 2

            # Delete A's namespace: B keeps its entries and its hits, A misses.
            with grpc.insecure_channel(daemon_addr) as channel:
                deleted = cache_pb2_grpc.CacheServiceStub(channel).Delete(
                    cache_pb2.DeleteRequest(namespace=ns_a), timeout=10)
            assert deleted.deleted == FULL_CHUNKS + 2
            namespaces = namespace_stats(daemon_addr)
            assert ns_a not in namespaces and namespaces[ns_b].entries == FULL_CHUNKS + 2
            _, hit_b = generate(stub_b, PROMPT + QUESTION, max_new_tokens=2, mode=pb.PREFIX_CACHE)
            assert hit_b.cached_tokens == len(PROMPT + QUESTION) - 1  # B stored this very prompt's tail
            _, miss_a = generate(stub_a, PROMPT + QUESTION, max_new_tokens=2, mode=pb.PREFIX_CACHE)
            assert miss_a.cached_tokens == 0
    finally:
        daemon.terminate()
