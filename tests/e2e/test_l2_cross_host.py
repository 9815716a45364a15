"""Two hosts' worth of real processes (daemon + service each, separate LMDB dirs) sharing one L2, a
single redis-server or a 3x3 Redis Cluster: a document warmed through service A is reused through
service B, and B's greedy output stays token-identical to plain model.generate."""
from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager

import pytest
import redis as redis_py
from kvboost.v1 import cache_pb2
from kvboost.v1 import inference_pb2 as pb

from cache_daemon.l2.redis_tier import CHUNK_PREFIX
from tests.conftest import pick_free_port
from tests.daemon_support import cache_stub
from tests.e2e.daemon_process import start_daemon
from tests.e2e.memory_load import memory_heavy_load
from tests.e2e.service_process import generate, running_service
from tests.e2e.stack_process import reference_ids, save_tiny_model
from tests.e2e.tenancy_support import as_tenant, write_tenants_file, write_token_file
from tests.redis_support import redis_cluster, redis_node, requires_redis

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), requires_redis]

# Byte-level tiny tokenizer: one token per character; 8-token chunks.
DOCUMENT = "Harbour rules: ferries to the lighthouse leave at dawn, bicycles pay two euros, dogs ride free. " * 3
QUESTION = " Q: when do ferries leave?"
MAX_NEW_TOKENS = 8
SERVICE_FLAGS = ("--chunk-size", "8")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@contextmanager
def l2_url(kind: str, folder):
    if kind == "node":
        with redis_node(folder / "redis") as node:
            yield node.url
    else:
        with redis_cluster(folder / "cluster") as cluster:
            yield cluster.url


def wait_for_l2_writes(daemon_address: str, num_chunks: int, timeout_s: float = 20.0, metadata=None) -> None:
    """Until the daemon's write-behind queue has written num_chunks chunks to L2."""
    deadline = time.monotonic() + timeout_s
    with cache_stub(daemon_address) as stub:
        while True:
            l2 = stub.Stats(cache_pb2.CacheStatsRequest(), timeout=5, metadata=metadata).l2
            if l2.writes >= num_chunks and l2.queued_writes == 0:
                return
            assert time.monotonic() < deadline, f"L2 writes stuck at {l2}"
            time.sleep(0.05)


@pytest.mark.parametrize("kind", ["node", "cluster"])
def test_a_document_warmed_on_host_a_is_reused_on_host_b(tmp_path, tiny_model_dir, kind):
    prompt = DOCUMENT + QUESTION
    with l2_url(kind, tmp_path) as url, two_hosts(tmp_path, tiny_model_dir, url) as (daemons, services):
        with services[0].stub() as stub_a:
            warmed = stub_a.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
        wait_for_l2_writes(daemons[0].address, warmed.chunks_stored)
        with services[1].stub() as stub_b:
            _, reused = generate(stub_b, prompt, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
        with cache_stub(daemons[1].address) as daemon_b:
            l2_on_b = daemon_b.Stats(cache_pb2.CacheStatsRequest(), timeout=5).l2
    assert reused.cached_tokens >= 0.9 * len(DOCUMENT) and reused.kv_reuse_ratio >= 0.75
    assert l2_on_b.hits >= warmed.chunks_stored - 1 and not l2_on_b.degraded
    assert list(reused.output_token_ids) == reference_ids(tiny_model_dir, prompt, MAX_NEW_TOKENS)


def test_tenancy_holds_in_l2_across_hosts(tmp_path, tiny_model_dir):
    """Both daemons take the same tenants file: alice's chunks warmed on A are hers on B, and bob on B
    reuses none of them (the tenants' key spaces come from one secret file given to both, never from L2)."""
    prompt = DOCUMENT + QUESTION
    tenants_file = write_tenants_file(tmp_path)
    secret_file = tmp_path / "tenancy.secret"
    secret_file.write_text("3c" * 32 + "\n")
    with redis_node(tmp_path / "redis") as node, ExitStack() as stack:
        daemons = []
        for name in ("a", "b"):
            daemon = start_daemon(tmp_path / f"lmdb-{name}", pick_free_port(), "--l2", node.url,
                                  "--tenants-file", str(tenants_file), "--tenancy-secret-file", str(secret_file))
            stack.callback(daemon.terminate)
            daemons.append(daemon)

        def service(daemon, tenant: str):
            return stack.enter_context(running_service(
                str(tiny_model_dir), daemon.address, pick_free_port(), tmp_path / f"{tenant}-{daemon.address[-5:]}.log",
                *SERVICE_FLAGS, "--cache-auth-token-file", str(write_token_file(tmp_path, tenant))))

        with service(daemons[0], "alice").stub() as alice_a:
            warmed = alice_a.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
        # The admin sees the daemon-wide L2 counters (a tenant's Stats shows none).
        wait_for_l2_writes(daemons[0].address, warmed.chunks_stored, metadata=as_tenant("ops"))
        with service(daemons[1], "bob").stub() as bob_b:
            _, bob_result = generate(bob_b, prompt, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
        with service(daemons[1], "alice").stub() as alice_b:
            _, alice_result = generate(alice_b, prompt, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
    assert warmed.chunks_stored > 0
    assert bob_result.cached_tokens == 0, "bob reused alice's chunks through L2"
    assert alice_result.cached_tokens >= 0.9 * len(DOCUMENT)
    expected = reference_ids(tiny_model_dir, prompt, MAX_NEW_TOKENS)
    assert list(alice_result.output_token_ids) == expected == list(bob_result.output_token_ids)


@contextmanager
def two_hosts(tmp_path, tiny_model_dir, url):
    """Daemons A and B on one L2, each with its own service (co-located reads, the default)."""
    with ExitStack() as stack:
        daemons = []
        for name in ("a", "b"):
            daemon = start_daemon(tmp_path / f"lmdb-{name}", pick_free_port(), "--l2", url)
            stack.callback(daemon.terminate)
            daemons.append(daemon)
        services = [stack.enter_context(running_service(str(tiny_model_dir), daemon.address, pick_free_port(),
                                                        tmp_path / f"service-{index}.log", *SERVICE_FLAGS))
                    for index, daemon in enumerate(daemons)]
        yield daemons, services


def test_under_memory_load_a_document_warmed_on_host_a_is_reused_on_host_b(tmp_path, tiny_model_dir):
    """The busy machine of the report (two processes rewriting 256 MB buffers): B's Lookup answers from its
    index and a value-free check of L2, the values arrive behind it, and B reuses the document."""
    prompt = DOCUMENT + QUESTION
    with redis_node(tmp_path / "redis") as node, two_hosts(tmp_path, tiny_model_dir, node.url) as (daemons, services):
        with services[0].stub() as stub_a:
            warmed = stub_a.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
        wait_for_l2_writes(daemons[0].address, warmed.chunks_stored)
        with memory_heavy_load(), services[1].stub() as stub_b:
            _, reused = generate(stub_b, prompt, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
        with cache_stub(daemons[1].address) as daemon_b:
            l2_on_b = daemon_b.Stats(cache_pb2.CacheStatsRequest(), timeout=5).l2
        service_log = services[1].log()
    assert reused.kv_reuse_ratio >= 0.9, (reused, service_log[-2000:])
    assert l2_on_b.hits >= warmed.chunks_stored - 1 and not l2_on_b.degraded
    assert "unreachable" not in service_log
    assert list(reused.output_token_ids) == reference_ids(tiny_model_dir, prompt, MAX_NEW_TOKENS)


def test_a_record_failing_its_mac_on_b_ends_the_reuse_run_there(tmp_path, tiny_model_dir):
    """The first chunks are warmed alone, then the whole document: one of the later records is altered in
    Redis. B's Lookup reports it (it reads no value), its promotion finds the MAC failing, and B's run ends
    there: the chunks before it are reused, the rest computed, the output unchanged."""
    prompt = DOCUMENT + QUESTION
    head = DOCUMENT[:len(DOCUMENT) // 2]
    with redis_node(tmp_path / "redis") as node, two_hosts(tmp_path, tiny_model_dir, node.url) as (daemons, services):
        client = redis_py.Redis(host="127.0.0.1", port=node.port)
        with services[0].stub() as stub_a:
            warmed_head = stub_a.Warm(pb.WarmRequest(text=head), timeout=60)
            wait_for_l2_writes(daemons[0].address, warmed_head.chunks_stored)
            head_records = set(client.keys(CHUNK_PREFIX + b"*"))
            warmed = stub_a.Warm(pb.WarmRequest(text=DOCUMENT), timeout=60)
        wait_for_l2_writes(daemons[0].address, warmed_head.chunks_stored + warmed.chunks_stored)
        later = sorted(set(client.keys(CHUNK_PREFIX + b"*")) - head_records)
        altered = bytearray(client.get(later[0]))
        altered[-1] ^= 0x01
        client.set(later[0], bytes(altered))
        with services[1].stub() as stub_b:
            _, reused = generate(stub_b, prompt, max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
        client.close()
    num_chunks = len(DOCUMENT) // 8
    assert later and warmed_head.chunks_stored > 0
    assert 8 * warmed_head.chunks_stored <= reused.cached_tokens < 8 * num_chunks
    assert list(reused.output_token_ids) == reference_ids(tiny_model_dir, prompt, MAX_NEW_TOKENS)
