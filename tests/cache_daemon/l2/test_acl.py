"""The ACL that docs/scaling.md recommends for the daemons' Redis user is enough for every L2 call, and no more."""
from __future__ import annotations

import zlib

import pytest
import redis

from cache_daemon.entry import ChunkKey, IncomingChunk
from cache_daemon.l2.address import parse_l2_address
from cache_daemon.l2.record_auth import parse_keyring
from cache_daemon.l2.redis_tier import RedisTier
from tests.daemon_support import NAMESPACE, TEST_L2_KEY, digest
from tests.redis_support import redis_node, requires_redis

pytestmark = requires_redis

# As in docs/scaling.md ("TLS and ACLs for Redis"); Redis 7.2+ also knows +client|setinfo.
DAEMON_ACL = ("on", ">daemon-password", "resetkeys", "~kvb:*", "resetchannels", "-@all", "+get", "+set", "+sadd",
              "+smembers", "+del", "+ping", "+hello", "+auth", "+client|setname", "+wait", "+cluster|slots",
              "+cluster|shards", "+info")


def test_the_documented_acl_lets_the_daemon_work_and_nothing_else(tmp_path):
    with redis_node(tmp_path / "redis") as node:
        assert node.cli("ACL", "SETUSER", "kvboost", *DAEMON_ACL).strip() == "OK"
        tier = RedisTier(parse_l2_address(f"redis://kvboost:daemon-password@127.0.0.1:{node.port}"),
                         parse_keyring(TEST_L2_KEY))
        blob = b"kv" * 500
        chunk = IncomingChunk(key=ChunkKey(digest("acl")), namespace=NAMESPACE, content_key=digest("tokens"),
                              num_tokens=4, checksum=zlib.crc32(blob), pinned=False, blob=blob)
        tier.put([chunk], wait=True)  # SET, SADD, WAIT
        hits, candidates = tier.get_with_content([chunk.key], [chunk.content_key])  # GET, SMEMBERS
        assert hits[0].blob == blob and candidates == [[chunk.key]]
        assert tier.delete_namespace(NAMESPACE) == 1  # SMEMBERS, DEL
        as_daemon = redis.Redis(port=node.port, username="kvboost", password="daemon-password")
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_daemon.set("someone else's key", b"x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_daemon.flushall()
