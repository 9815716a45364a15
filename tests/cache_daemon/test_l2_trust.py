"""Whoever can write to Redis cannot make a daemon serve K/V it did not sign (real redis-server, two hosts)."""
from __future__ import annotations

import json
import zlib
from contextlib import ExitStack

import pytest
import redis as redis_py
from kvboost.v1 import cache_pb2

from cache_daemon.entry import ChunkKey, IncomingChunk
from cache_daemon.l2.record_auth import parse_keyring
from cache_daemon.l2.redis_tier import CHUNK_PREFIX, NAMESPACE_PREFIX, decode_record, encode_record
from cache_daemon.tenancy import PLAIN, KeySpace, tenant_secret
from tests.daemon_support import (NAMESPACE, TEST_L2_KEY, cache_stub, fetch_chunks, make_chunk, running_daemon,
                                  store_chunks)
from tests.redis_support import redis_node, requires_redis

pytestmark = requires_redis

# Same key id as the daemons' key, another secret: what someone who can write to Redis can produce.
FORGER = parse_keyring("test-k1 " + "66" * 32)
TOKENS = {"alice": "alice-token", "bob": "bob-token", "ops": "ops-token"}


def as_caller(name: str | None) -> dict:
    return {} if name is None else {"metadata": (("authorization", f"Bearer {TOKENS[name]}"),)}


def lookup_hits(stub, keys, caller=None) -> list[bool]:
    request = cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys)
    return list(stub.Lookup(request, **as_caller(caller)).prefix_hit)


def served(stub, keys, caller=None) -> list[bool]:
    """What B serves of the keys: a Lookup (which may report L2 keys as arriving, unverified), then Fetch,
    which waits for their promotion; a record failing its MAC never arrives and is a miss there."""
    lookup_hits(stub, keys, caller)
    return [chunk.found for chunk in fetch_chunks(stub, keys, **as_caller(caller))]


def l2_stats(stub) -> cache_pb2.L2Stats:
    return stub.Stats(cache_pb2.CacheStatsRequest(), **as_caller("ops")).l2


@pytest.fixture()
def redis(tmp_path):
    with redis_node(tmp_path / "redis") as node:
        yield node


@pytest.fixture(params=[False, True], ids=["one caller", "tenants"])
def hosts(request, tmp_path, redis):
    """Daemons A and B on one L2 with the same MAC key; with tenants, the same tenancy secret file too."""
    fields = {}
    if request.param:
        tenants = {name: {"token": token, **({"admin": True} if name == "ops" else {})}
                   for name, token in TOKENS.items()}
        (tmp_path / "tenants.json").write_text(json.dumps({"tenants": tenants}))
        (tmp_path / "tenancy.secret").write_text("77" * 32 + "\n")
        fields = dict(tenants_file=tmp_path / "tenants.json", tenancy_secret_file=tmp_path / "tenancy.secret")
    with ExitStack() as stack:
        pair = [stack.enter_context(running_daemon(tmp_path / name, l2=redis.url, **fields)) for name in "ab"]
        yield request.param, pair


def redis_client(redis) -> redis_py.Redis:
    return redis_py.Redis(host="127.0.0.1", port=redis.port)


def stored_record_key(client: redis_py.Redis, before: set[bytes]) -> bytes:
    """The one chunk record that appeared in Redis since `before` (as an observer of Redis sees it)."""
    new = {key for key in client.keys(CHUNK_PREFIX + b"*")} - before
    assert len(new) == 1, f"expected one new record, found {len(new)}"
    return new.pop()


def warm_on_a(hosts, redis, chunk, caller) -> bytes:
    """Stores chunk through A as caller, waits for the L2 write, returns its Redis key."""
    _, (host_a, _) = hosts
    client = redis_client(redis)
    before = set(client.keys(CHUNK_PREFIX + b"*"))
    with cache_stub(host_a.address) as stub_a:
        store_chunks(stub_a, [chunk], **as_caller(caller))
    assert host_a.cache.drain_writes(10)
    return stored_record_key(client, before)


def test_a_forged_record_with_valid_crcs_is_never_served(hosts, redis):
    tenants, (host_a, host_b) = hosts
    caller = "alice" if tenants else None
    genuine = make_chunk("system prompt", 3000)
    record_key = warm_on_a(hosts, redis, genuine, caller)
    client = redis_client(redis)
    # The attacker overwrites the record: same key, same namespace, CRC-correct header and blob, its own K/V.
    blob = b"attacker K/V" * 250
    planted = IncomingChunk(key=ChunkKey(record_key[len(CHUNK_PREFIX):]), namespace=stored_namespace(client, record_key),
                            content_key=b"", num_tokens=16, checksum=zlib.crc32(blob), pinned=False, blob=blob)
    client.set(record_key, encode_record(planted, FORGER))
    with cache_stub(host_b.address) as stub_b:
        assert served(stub_b, [genuine.key], caller) == [False]
        assert lookup_hits(stub_b, [genuine.key], caller) == [False], "the deleted record is not reported again"
        assert client.exists(record_key) == 0, "a forged record is deleted"
        assert (l2_stats(stub_b).forged, l2_stats(stub_b).corrupted) == (1, 0)
    # A still serves its own genuine copy from LMDB.
    with cache_stub(host_a.address) as stub_a:
        assert fetch_chunks(stub_a, [genuine.key], **as_caller(caller))[0].blob == genuine.blob


def test_a_genuine_record_copied_under_another_key_is_never_served(hosts, redis):
    tenants, (host_a, host_b) = hosts
    victim, attacker = ("bob", "alice") if tenants else (None, None)
    client = redis_client(redis)
    wanted = make_chunk("the victim's prompt", 3000)
    other = make_chunk("another prompt", 3000)
    victim_key = warm_on_a(hosts, redis, wanted, victim)
    other_key = warm_on_a(hosts, redis, other, attacker)  # with tenants: another tenant's genuine record
    # The attacker replaces the victim's record with a genuine one written under another key.
    client.set(victim_key, client.get(other_key))
    with cache_stub(host_b.address) as stub_b:
        assert served(stub_b, [wanted.key], victim) == [False]
        assert client.exists(victim_key) == 0
        assert l2_stats(stub_b).forged == 1
        # The copied record under its own key is genuine: its owner still gets it on B (the test can fail).
        assert served(stub_b, [other.key], attacker) == [True]
        assert fetch_chunks(stub_b, [other.key], **as_caller(attacker))[0].blob == other.blob


def test_a_record_planted_under_a_new_key_is_never_served(hosts, redis):
    """Nothing stored the key before: the attacker computes a popular prompt's key and plants K/V."""
    tenants, (_, host_b) = hosts
    caller = "alice" if tenants else None
    client = redis_client(redis)
    with cache_stub(host_b.address) as stub_b:
        target = make_chunk("a popular prompt", 2000)
        assert lookup_hits(stub_b, [target.key], caller) == [False]
        space = key_space(caller)
        record_key = ChunkKey(space.scope(target.key))
        planted = IncomingChunk(key=record_key, namespace=space.scope(NAMESPACE), content_key=b"", num_tokens=16,
                                checksum=target.checksum, pinned=False, blob=target.blob)
        client.set(CHUNK_PREFIX + record_key, encode_record(planted, FORGER))
        client.sadd(NAMESPACE_PREFIX + planted.namespace, record_key)
        assert served(stub_b, [target.key], caller) == [False]
        assert l2_stats(stub_b).forged == 1
        # Signed with the daemons' key, the same record is served: the MAC, not anything else, decided.
        client.set(CHUNK_PREFIX + record_key, encode_record(planted, parse_keyring(TEST_L2_KEY)))
        assert served(stub_b, [target.key], caller) == [True]


def test_no_secret_of_ours_is_in_redis(hosts, redis):
    tenants, _ = hosts
    warm_on_a(hosts, redis, make_chunk("anything", 1000), "alice" if tenants else None)
    client = redis_client(redis)
    keys = client.keys(b"*")
    assert keys and not [key for key in keys if key.startswith(b"kvb:shared:")]
    secrets = (bytes.fromhex("77" * 32), bytes.fromhex(TEST_L2_KEY.split()[1]))
    assert not [key for key in keys for secret in secrets if secret in client.dump(key)]


def stored_namespace(client: redis_py.Redis, record_key: bytes) -> bytes:
    """The namespace as stored (tenant-scoped), read from the genuine record's header."""
    record = client.get(record_key)
    hit, _ = decode_record(ChunkKey(record_key[len(CHUNK_PREFIX):]), record, parse_keyring(TEST_L2_KEY))
    return hit.entry.namespace


def key_space(caller: str | None) -> KeySpace:
    """The caller's key space: the test plays an attacker who learned where a key is stored (worst case)."""
    if caller is None:
        return PLAIN
    return KeySpace(tenant_secret(bytes.fromhex("77" * 32), caller))
