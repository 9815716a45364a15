"""A real daemon with a tenants file: tenant bob's token reaches none of tenant alice's chunks, on any RPC."""
from __future__ import annotations

import grpc
import pytest
from kvboost.v1 import cache_pb2, cache_pb2_grpc

from tests.conftest import pick_free_port
from tests.daemon_support import digest, fetch_chunks, make_chunk, rpc_error, store_chunks, store_frames
from tests.e2e.daemon_process import start_daemon
from tests.e2e.tenancy_support import TOKENS, as_tenant, metric_value, scrape, write_tenants_file

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ALICE, BOB, OPS = as_tenant("alice"), as_tenant("bob"), as_tenant("ops")
NAMESPACE = digest("shared model namespace")  # both tenants run the same model without a salt
CONTENT_KEYS = [digest("content 0"), digest("content 1")]
ALICE_CHUNKS = [make_chunk(f"alice {index}", 3000, namespace=NAMESPACE, content_key=CONTENT_KEYS[index])
                for index in range(2)]
KEYS = [chunk.key for chunk in ALICE_CHUNKS]
# Bob's forgeries: alice's prefix keys and content keys, bob's bytes.
POISON = [make_chunk(f"poison {index}", 3000, namespace=NAMESPACE, content_key=CONTENT_KEYS[index])
          for index in range(2)]
POISON = [type(chunk)(key=KEYS[index], blob=chunk.blob, namespace=NAMESPACE, content_key=CONTENT_KEYS[index])
          for index, chunk in enumerate(POISON)]
# Bob also tries a fresh prefix key carrying alice's content key (a poisoned content hit).
POISON_BY_CONTENT = make_chunk("poison by content", 3000, namespace=NAMESPACE, content_key=CONTENT_KEYS[0])
MALFORMED = [None, [("authorization", "Bearer")], [("authorization", "Bearer wrong-token")],
             [("authorization", TOKENS["alice"])], [("authorization", f"bearer {TOKENS['alice']}")],
             [("authorization", f"Bearer {TOKENS['alice']} ")], [("authorization", f"Bearer {TOKENS['alice']}x")],
             [("authorization", f"Basic {TOKENS['ops']}")]]


def lookup(stub, metadata, keys=KEYS, content_keys=CONTENT_KEYS) -> cache_pb2.LookupReply:
    return stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys, content_keys=content_keys),
                       metadata=metadata, timeout=5)


def alice_still_has_her_chunks(stub) -> None:
    assert lookup(stub, ALICE).prefix_run == 2
    fetched = fetch_chunks(stub, KEYS, metadata=ALICE)
    assert [chunk.blob for chunk in fetched] == [chunk.blob for chunk in ALICE_CHUNKS]
    assert [chunk.meta.namespace for chunk in fetched] == [NAMESPACE] * 2, "metadata comes back unscoped"
    assert [chunk.meta.content_key for chunk in fetched] == CONTENT_KEYS
    # A content lookup under a new context finds alice's own chunk, never bob's forgery.
    reply = lookup(stub, ALICE, keys=[digest("new context")], content_keys=[CONTENT_KEYS[0]])
    assert [(hit.index, hit.stored_key) for hit in reply.content_hits] == [(0, KEYS[0])]


def test_bob_cannot_read_poison_delete_or_pin_alices_chunks(tmp_path) -> None:
    metrics_port = pick_free_port()
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port(), "--tenants-file", str(write_tenants_file(tmp_path)),
                          "--metrics-port", str(metrics_port))
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            # Bob plants forgeries under alice's keys before she has stored anything ...
            assert store_chunks(stub, POISON, metadata=BOB).stored == 2
            assert store_chunks(stub, ALICE_CHUNKS, metadata=ALICE).stored == 2, "alice's keys are still free"
            # ... and after: the same keys are his own again, so "already present", never her bytes.
            reply = store_chunks(stub, POISON + [POISON_BY_CONTENT], metadata=BOB)
            assert (reply.stored, reply.already_present) == (1, 2)
            alice_still_has_her_chunks(stub)

            # Reading: bob's lookups and fetches of alice's keys find only his own forgeries.
            assert [chunk.blob for chunk in fetch_chunks(stub, KEYS, metadata=BOB)] == [c.blob for c in POISON]
            unknown = [digest("never stored 0"), digest("never stored 1")]
            assert lookup(stub, BOB, keys=unknown).prefix_run == 0
            assert not any(chunk.found for chunk in fetch_chunks(stub, unknown, metadata=BOB))

            # Deleting: by keys and by namespace, bob removes his own chunks only, then finds nothing.
            alice_epoch, bob_epoch = lookup(stub, ALICE).delete_count, lookup(stub, BOB).delete_count
            assert stub.Delete(cache_pb2.DeleteRequest(keys=KEYS), metadata=BOB, timeout=5).deleted == 2
            assert stub.Delete(cache_pb2.DeleteRequest(namespace=NAMESPACE), metadata=BOB, timeout=5).deleted == 1
            assert rpc_error(stub.Delete, cache_pb2.DeleteRequest(namespace=NAMESPACE), metadata=BOB,
                             timeout=5).code() == grpc.StatusCode.NOT_FOUND
            assert stub.Delete(cache_pb2.DeleteRequest(keys=KEYS, corrupted=True), metadata=BOB,
                               timeout=5).deleted == 0
            # His four Deletes move his delete epoch on, not hers: she learns nothing of them.
            assert (lookup(stub, ALICE).delete_count, lookup(stub, BOB).delete_count) == (alice_epoch, bob_epoch + 4)
            # The admin's Delete could name anyone's chunks: it moves every tenant's epoch (found or not).
            assert stub.Delete(cache_pb2.DeleteRequest(keys=[digest("never stored")]), metadata=OPS,
                               timeout=5).deleted == 0
            assert (lookup(stub, ALICE).delete_count, lookup(stub, BOB).delete_count) == (alice_epoch + 1,
                                                                                          bob_epoch + 5)
            # A write-back computed before those Deletes: bob's own Deletes (in his key space) keep his chunks out;
            # alice's, at her epoch from before the admin's Delete, is not left out (it named none of hers).
            def late_store(chunks, metadata, count):
                frames = store_frames(chunks, delete_epoch_id=lookup(stub, metadata).delete_epoch_id, delete_count=count)
                return stub.Store(iter(frames), metadata=metadata, timeout=5)

            assert late_store(POISON, BOB, bob_epoch).superseded == 2
            reply = late_store(ALICE_CHUNKS[:1], ALICE, alice_epoch)
            assert (reply.already_present, reply.superseded) == (1, 0)
            # Her count holds her own Delete, not bob's four: at the epoch after it her write-back is stored again.
            assert stub.Delete(cache_pb2.DeleteRequest(keys=KEYS[:1]), metadata=ALICE, timeout=5).deleted == 1
            reply = late_store(ALICE_CHUNKS[:1], ALICE, lookup(stub, ALICE).delete_count)
            assert (reply.stored, reply.superseded) == (1, 0)
            # Now bob holds nothing: alice's keys are plain misses for him, as never-stored keys are.
            assert lookup(stub, BOB).prefix_run == 0 and not lookup(stub, BOB).content_hits
            assert not any(chunk.found for chunk in fetch_chunks(stub, KEYS, metadata=BOB))

            # Pinning: alice's keys are unknown to bob, exactly like never-stored ones.
            for method in (stub.Pin, stub.Unpin):
                for keys in (KEYS, unknown):
                    assert rpc_error(method, cache_pb2.PinRequest(keys=keys), metadata=BOB,
                                     timeout=5).code() == grpc.StatusCode.NOT_FOUND

            # Stats: each tenant sees its own namespaces only, unscoped; daemon-wide counters stay hidden.
            bob_stats = stub.Stats(cache_pb2.CacheStatsRequest(), metadata=BOB, timeout=5)
            assert (bob_stats.entries, bob_stats.bytes, list(bob_stats.namespaces)) == (0, 0, [])
            assert (bob_stats.hits, bob_stats.misses, bob_stats.bytes_written) == (0, 0, 0)
            alice_stats = stub.Stats(cache_pb2.CacheStatsRequest(), metadata=ALICE, timeout=5)
            assert [(ns.namespace, ns.entries) for ns in alice_stats.namespaces] == [(NAMESPACE, 2)]
            assert alice_stats.entries == 2 and alice_stats.bytes == 6000

            # Describe (the LMDB directory: every tenant's blobs) is for the admin only.
            for tenant in (ALICE, BOB):
                assert rpc_error(stub.Describe, cache_pb2.DescribeRequest(), metadata=tenant,
                                 timeout=5).code() == grpc.StatusCode.PERMISSION_DENIED
            assert stub.Describe(cache_pb2.DescribeRequest(), metadata=OPS, timeout=5).data_dir

            # The admin sees every chunk as stored: alice's keys are not stored as she sent them.
            ops_stats = stub.Stats(cache_pb2.CacheStatsRequest(), metadata=OPS, timeout=5)
            assert ops_stats.entries == 2 and len(ops_stats.namespaces) == 1
            assert ops_stats.namespaces[0].namespace != NAMESPACE
            assert lookup(stub, OPS).prefix_run == 0

            # Malformed and unknown tokens are refused on every RPC; health stays open.
            lookup_request = cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=KEYS)
            calls = [(stub.Lookup, lookup_request), (stub.Fetch, cache_pb2.FetchRequest(keys=KEYS)),
                     (stub.Store, iter(store_frames(POISON))), (stub.Stats, cache_pb2.CacheStatsRequest()),
                     (stub.Delete, cache_pb2.DeleteRequest(keys=KEYS)), (stub.Pin, cache_pb2.PinRequest(keys=KEYS)),
                     (stub.Describe, cache_pb2.DescribeRequest())]
            for metadata in MALFORMED:
                for method, request in calls:
                    if method is stub.Store:
                        request = iter(store_frames(POISON))
                    assert rpc_error(method, request, metadata=metadata,
                                     timeout=5).code() == grpc.StatusCode.UNAUTHENTICATED
            alice_still_has_her_chunks(stub)
            assert stub.Delete(cache_pb2.DeleteRequest(namespace=NAMESPACE), metadata=ALICE, timeout=5).deleted == 2

        metrics = scrape(metrics_port)
        assert metric_value(metrics, "kvboost_cache_refusals_total", reason="unauthenticated") == len(MALFORMED) * 7
        assert metric_value(metrics, "kvboost_cache_refusals_total", reason="permission_denied") == 2
    finally:
        daemon.terminate()
    for token in TOKENS.values():
        assert token not in daemon.log(), "tokens are never logged"


def test_a_rotated_token_is_refused_and_the_tenant_keeps_its_chunks_after_a_restart(tmp_path) -> None:
    data_dir, port = tmp_path / "lmdb", pick_free_port()
    daemon = start_daemon(data_dir, port, "--tenants-file", str(write_tenants_file(tmp_path)))
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            assert store_chunks(stub, ALICE_CHUNKS, metadata=ALICE).stored == 2
    finally:
        daemon.terminate()
    # Alice's token leaked: the operator gives her a new one and restarts the daemon.
    rotated = {**TOKENS, "alice": "alice-rotated-7c11-token"}
    (tmp_path / "rotated").mkdir()
    daemon = start_daemon(data_dir, port, "--tenants-file", str(write_tenants_file(tmp_path / "rotated", rotated)))
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            assert rpc_error(stub.Lookup, cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=KEYS),
                             metadata=ALICE, timeout=5).code() == grpc.StatusCode.UNAUTHENTICATED
            new_alice = as_tenant("alice", rotated)
            # The tenant's name, not its token, fixes its key space; the daemon's secret is in LMDB.
            assert lookup(stub, new_alice).prefix_run == 2
            assert [c.blob for c in fetch_chunks(stub, KEYS, metadata=new_alice)] == [c.blob for c in ALICE_CHUNKS]
            stats = stub.Stats(cache_pb2.CacheStatsRequest(), metadata=new_alice, timeout=5)
            assert [(ns.namespace, ns.entries) for ns in stats.namespaces] == [(NAMESPACE, 2)], "owners persist"
            assert lookup(stub, BOB).prefix_run == 0
    finally:
        daemon.terminate()


def test_tenants_file_and_single_token_exclude_each_other(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("one-token")
    with pytest.raises(RuntimeError, match="exclude each other"):
        start_daemon(tmp_path / "lmdb", pick_free_port(), "--tenants-file", str(write_tenants_file(tmp_path)),
                     "--auth-token-file", str(token_file), timeout_s=20)


def test_bob_filling_his_share_never_evicts_alices_chunks_before_or_after_a_restart(tmp_path) -> None:
    # Without shares, bob's 60 kB would push alice's 30 kB out of the 60 kB budget (hers are older).
    data_dir, port, metrics_port = tmp_path / "lmdb", pick_free_port(), pick_free_port()
    tenants_file = write_tenants_file(tmp_path, budgets={"bob": 20_000})
    flags = ("--tenants-file", str(tenants_file), "--max-bytes", "60000", "--metrics-port", str(metrics_port))
    alice_chunks = [make_chunk(f"alice share {index}", 3000, namespace=NAMESPACE) for index in range(10)]
    bob_chunks = [make_chunk(f"bob share {index}", 3000, namespace=NAMESPACE) for index in range(40)]

    def alice_keeps_everything(stub) -> None:
        fetched = fetch_chunks(stub, [chunk.key for chunk in alice_chunks], metadata=ALICE)
        assert [chunk.blob for chunk in fetched] == [chunk.blob for chunk in alice_chunks]

    def bob_stays_inside_his_share(stub) -> None:
        stats = stub.Stats(cache_pb2.CacheStatsRequest(), metadata=BOB, timeout=5)
        assert (stats.bytes, stats.max_bytes) == (18_000, 20_000), "six 3000-byte chunks fit in 20 kB"
        assert metric_value(scrape(metrics_port), "kvboost_cache_tenant_bytes", tenant="bob") == 18_000

    daemon = start_daemon(data_dir, port, *flags)
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            assert store_chunks(stub, alice_chunks, metadata=ALICE).stored == 10
            for start in range(0, 20, 4):
                assert store_chunks(stub, bob_chunks[start:start + 4], metadata=BOB).stored == 4
            alice_keeps_everything(stub)
            bob_stays_inside_his_share(stub)
            alice_stats = stub.Stats(cache_pb2.CacheStatsRequest(), metadata=ALICE, timeout=5)
            assert (alice_stats.bytes, alice_stats.max_bytes) == (30_000, 60_000), "no share: the daemon's budget"
            # Bob keeps his newest chunks: the least recently used of his own went first (ties within one
            # Store go by key, so which 2 of the 4 before the last Store stay is the keys' order).
            held = [chunk.found for chunk in fetch_chunks(stub, [c.key for c in bob_chunks[:20]], metadata=BOB)]
            assert held[16:] == [True] * 4 and sum(held[12:16]) == 2 and not any(held[:12])
    finally:
        daemon.terminate()
    daemon = start_daemon(data_dir, port, *flags)
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            bob_stays_inside_his_share(stub)  # his share's usage is rebuilt from LMDB at open
            for start in range(20, 40, 5):
                store_chunks(stub, bob_chunks[start:start + 5], metadata=BOB)
            alice_keeps_everything(stub)
            bob_stays_inside_his_share(stub)
    finally:
        daemon.terminate()
