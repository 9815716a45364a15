"""Reuse inside a chunk, the daemon's part: chunks stored with their parent key and token ids are indexed per
parent; a Lookup with continue_parent answers the stored chunk sharing the most leading tokens."""
from __future__ import annotations

import hashlib
import json
import math
import struct

import grpc
import pytest

from cache_daemon import cache as cache_module
from cache_daemon.cache import ChunkCache
from cache_daemon.entry import IncomingChunk
from cache_daemon.store import LmdbStore
from kvboost.v1 import cache_pb2
from tests.cache_daemon.test_cache import FakeClock, open_cache
from tests.daemon_support import NAMESPACE, cache_stub, digest, header_frame, make_chunk, running_daemon, rpc_error

PARENT = digest("parent")


def packed(tokens) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def child(label, tokens, parent: bytes = PARENT, namespace: bytes = NAMESPACE, size: int = 200) -> IncomingChunk:
    sample = make_chunk(label, size)
    return IncomingChunk(key=sample.key, namespace=namespace, content_key=b"", num_tokens=len(tokens),
                         checksum=sample.checksum, pinned=False, blob=sample.blob, parent_key=parent,
                         token_ids=packed(tokens))


@pytest.fixture()
def cache(tmp_path):
    cache = open_cache(tmp_path / "lmdb", max_bytes=100_000)
    yield cache
    cache.close()


def test_the_longest_common_prefix_wins(cache: ChunkCache) -> None:
    cache.put_many([child("a", [1, 2, 3, 4, 5, 6]), child("b", [1, 2, 3, 9]), child("c", [7, 8])])
    assert cache.continuation(NAMESPACE, PARENT, packed([1, 2, 3, 4, 0])) == (digest("a"), 4)
    assert cache.continuation(NAMESPACE, PARENT, packed([1, 2, 3, 9, 9, 9])) == (digest("b"), 4)
    assert cache.continuation(NAMESPACE, PARENT, packed([1, 2])) == (digest("a"), 2)  # shorter than both
    assert cache.continuation(NAMESPACE, PARENT, packed([7])) == (digest("c"), 1)
    assert cache.continuation(NAMESPACE, PARENT, packed([5, 1, 2])) is None  # no first token in common
    assert cache.continuation(NAMESPACE, digest("other parent"), packed([1, 2, 3])) is None
    assert cache.continuation(digest("other namespace"), PARENT, packed([1, 2, 3])) is None


def test_ties_go_to_the_chunk_eviction_keeps_longest(cache: ChunkCache) -> None:
    cache.put_many([child("cold", [1, 2, 3, 4]), child("hot", [1, 2, 3, 5])])
    for _ in range(3):
        cache.lookup(NAMESPACE, [digest("hot")], [])
    cache.flush_hits()
    assert cache.continuation(NAMESPACE, PARENT, packed([1, 2, 3, 0])) == (digest("hot"), 3)
    before = cache.stats().counters.hits
    cache.continuation(NAMESPACE, PARENT, packed([1, 2, 3, 0]))
    assert cache.stats().counters.hits == before + 1  # a continuation found counts as a hit of that chunk


def test_delete_eviction_and_namespace_delete_leave_the_index(tmp_path) -> None:
    cache = open_cache(tmp_path / "lmdb", max_bytes=1000)
    try:
        cache.put_many([child("a", [1, 2, 3], size=400), child("b", [1, 2, 4], size=400)])
        cache.delete_keys([digest("a")])
        assert [key for key, _ in cache.store.children(PARENT)] == [digest("b")]
        cache.put_many([child("c", [1, 9], size=400), child("d", [1, 8], size=400)])  # evicts b to fit
        assert digest("b") not in {key for key, _ in cache.store.children(PARENT)}
        assert cache.continuation(NAMESPACE, PARENT, packed([1, 2, 4])) in ((digest("c"), 1), (digest("d"), 1))
        cache.delete_namespace(NAMESPACE)
        assert cache.store.children(PARENT) == []
        assert cache.continuation(NAMESPACE, PARENT, packed([1])) is None
    finally:
        cache.close()


def test_the_index_survives_a_restart(tmp_path) -> None:
    cache = open_cache(tmp_path / "lmdb")
    cache.put_many([child("a", [4, 5, 6])])
    cache.close()
    reopened = ChunkCache(LmdbStore(tmp_path / "lmdb", map_size=1 << 20), 10_000, math.inf, clock=FakeClock())
    try:
        assert reopened.continuation(NAMESPACE, PARENT, packed([4, 5, 0])) == (digest("a"), 2)
    finally:
        reopened.close()


def test_a_parent_keeps_at_most_max_children(cache: ChunkCache, monkeypatch) -> None:
    monkeypatch.setattr(cache_module, "MAX_CHILDREN", 3)
    cache.put_many([child("keep-1", [1, 1]), child("keep-2", [1, 2]), child("drop", [1, 3])])
    for _ in range(2):
        cache.lookup(NAMESPACE, [digest("keep-1"), digest("keep-2")], [])
    cache.flush_hits()
    cache.put_many([child("new", [1, 4])])
    indexed = {key for key, _ in cache.store.children(PARENT)}
    assert indexed == {digest("keep-1"), digest("keep-2"), digest("new")}
    assert cache.read(digest("drop"), bytes) is not None  # out of the index, still stored under its own key


def test_chunks_without_continuation_fields_are_stored_unindexed(cache: ChunkCache) -> None:
    plain = child("plain", [1, 2])
    cache.put_many([IncomingChunk(key=plain.key, namespace=NAMESPACE, content_key=b"", num_tokens=2,
                                  checksum=plain.checksum, pinned=False, blob=plain.blob)])
    assert cache.store.children(PARENT) == []
    assert cache.read(plain.key, bytes) is not None


# ---- over gRPC, tenants included ---------------------------------------------------------------------------

TOKENS = {"alice": "alice-token", "bob": "bob-token"}


def store(stub, label, tokens, token: str | None = None, parent: bytes = PARENT) -> None:
    sample = make_chunk(label, 300)
    frames = [header_frame(sample, parent_key=parent, token_ids=packed(tokens)), cache_pb2.ChunkFrame(data=sample.blob)]
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    stub.Store(iter(frames), metadata=metadata, timeout=10)


def lookup(stub, tokens, token: str | None = None, parent: bytes = PARENT):
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    return stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, continue_parent=parent,
                                               continue_tokens=packed(tokens)), metadata=metadata, timeout=10)


def test_lookup_over_grpc_and_bad_continuations(tmp_path) -> None:
    with running_daemon(tmp_path / "lmdb") as daemon, cache_stub(daemon.address) as stub:
        store(stub, "doc+q1", [10, 11, 12, 13])
        reply = lookup(stub, [10, 11, 99])
        assert (reply.continuation_key, reply.continuation_tokens) == (digest("doc+q1"), 2)
        assert lookup(stub, [99]).continuation_key == b""
        for request in (cache_pb2.LookupRequest(namespace=NAMESPACE, continue_parent=PARENT),
                        cache_pb2.LookupRequest(namespace=NAMESPACE, continue_parent=b"short", continue_tokens=b"\0" * 4),
                        cache_pb2.LookupRequest(namespace=NAMESPACE, continue_parent=PARENT, continue_tokens=b"\0" * 5)):
            error = rpc_error(stub.Lookup, request, timeout=10)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        sample = make_chunk("odd", 100)
        frames = [header_frame(sample, token_ids=packed([1])), cache_pb2.ChunkFrame(data=sample.blob)]
        error = rpc_error(stub.Store, iter(frames), timeout=10)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "both" in error.details()


def test_a_tenant_never_matches_another_tenants_continuations(tmp_path) -> None:
    tenants = {name: {"token": token} for name, token in TOKENS.items()}
    (tmp_path / "tenants.json").write_text(json.dumps({"tenants": tenants}))
    (tmp_path / "tenancy.secret").write_text("42" * 32 + "\n")
    with running_daemon(tmp_path / "lmdb", tenants_file=tmp_path / "tenants.json",
                        tenancy_secret_file=tmp_path / "tenancy.secret") as daemon, \
            cache_stub(daemon.address) as stub:
        store(stub, "alice's", [1, 2, 3, 4], TOKENS["alice"])
        mine = lookup(stub, [1, 2, 3, 0], TOKENS["alice"])
        assert (mine.continuation_key, mine.continuation_tokens) == (digest("alice's"), 3)
        assert lookup(stub, [1, 2, 3, 0], TOKENS["bob"]).continuation_key == b""


# ---- one Lookup for the run and what continues it (continue_after_run) ------------------------------------------

def chained(parent: bytes, tokens) -> bytes:
    """A prefix key as the inference service chains them: SHA-256(parent || packed tokens)."""
    return hashlib.sha256(parent + packed(tokens)).digest()


def store_keyed(stub, key: bytes, tokens, parent: bytes | None = None) -> None:
    sample = make_chunk(key.hex(), 300)
    fields = dict(key=key, num_tokens=len(tokens))
    if parent is not None:  # indexed as a continuation of parent
        fields.update(parent_key=parent, token_ids=packed(tokens))
    stub.Store(iter([header_frame(sample, **fields), cache_pb2.ChunkFrame(data=sample.blob)]), timeout=10)


def test_one_lookup_answers_the_run_and_the_partial_chunk_after_it(tmp_path) -> None:
    # A prompt of chunks [1 2 3 4] [5 6 7 8] and a tail [9]; stored: the first chunk, and after it a partial chunk
    # [5 6] (not indexed, as L2-promoted chunks are) and a continuation [5 6 7 0] (indexed).
    first = chained(NAMESPACE, [1, 2, 3, 4])
    second = chained(first, [5, 6, 7, 8])
    after = [packed([1, 2, 3]), packed([5, 6, 7]), packed([9])]  # run 0, 1, 2: the next chunk but its last; the tail
    with running_daemon(tmp_path / "lmdb") as daemon, cache_stub(daemon.address) as stub:
        store_keyed(stub, first, [1, 2, 3, 4], parent=NAMESPACE)
        store_keyed(stub, chained(first, [5, 6]), [5, 6])
        store_keyed(stub, digest("continuation"), [5, 6, 7, 0], parent=first)
        reply = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[first, second],
                                                    continue_after_run=after), timeout=10)
        assert (reply.prefix_run, reply.continued) == (1, True)
        assert (reply.partial_key, reply.partial_tokens) == (chained(first, [5, 6]), 2)  # derived by the daemon
        assert (reply.continuation_key, reply.continuation_tokens) == (digest("continuation"), 3)
        # Nothing stored at all: the run is 0, and the continuation of the namespace is the first chunk itself.
        reply = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[digest("x"), second],
                                                    continue_after_run=after), timeout=10)
        assert (reply.prefix_run, reply.continued, reply.partial_key) == (0, True, b"")
        assert (reply.continuation_key, reply.continuation_tokens) == (first, 3)
        # A request without it is answered as before (older clients): no continuation, continued unset.
        reply = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[first, second]), timeout=10)
        assert (reply.prefix_run, reply.continued, reply.partial_key, reply.continuation_key) == (1, False, b"", b"")


def test_bad_continue_after_run_is_invalid_argument(tmp_path) -> None:
    keys = [digest("a"), digest("b")]
    with running_daemon(tmp_path / "lmdb") as daemon, cache_stub(daemon.address) as stub:
        for request, words in (
                (cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys, continue_after_run=[b""] * 4),
                 "at most one per run length"),
                (cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys, continue_after_run=[b"\0" * 5]),
                 "multiple of 4 bytes"),
                (cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys, continue_after_run=[b"\0" * 4],
                                         continue_parent=PARENT, continue_tokens=b"\0" * 4), "not both")):
            error = rpc_error(stub.Lookup, request, timeout=10)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.details()
