"""Chunks in Redis or Redis Cluster: the only module that imports redis."""
from __future__ import annotations

import dataclasses
import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

from cache_daemon.entry import ChunkKey, Entry, IncomingChunk
from cache_daemon.l2.address import L2Address
from cache_daemon.l2.record_auth import MAC_SIZE, L2Keyring
from cache_daemon.l2.tls import L2TlsFiles
from cache_daemon.store import decode_entry, encode_entry
from kvboost_common.checksum import crc32

if TYPE_CHECKING:
    import redis
    from redis.cluster import RedisCluster

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _redis():
    """redis-py, imported when a tier first connects: a daemon without --l2 never loads it (~0.1 s of its start)."""
    import redis
    import redis.cluster

    return redis

# Key layout (binary keys; the 32-byte digests are the daemon's stored keys, tenant-scoped already):
CHUNK_PREFIX = b"kvb:chunk:"  # + key -> record (below)
CONTENT_PREFIX = b"kvb:content:"  # + content key -> set of keys stored with those tokens
NAMESPACE_PREFIX = b"kvb:ns:"  # + namespace -> set of its keys (for Delete by namespace)
# A record: u8 key id length, key id, MAC, then the signed part: u16 header length, encoded Entry, blob.
# The MAC (cache_daemon.l2.record_auth) covers the key id, the record's own key and the signed part,
# so a record is valid under the key it was written to and nowhere else.
_HEADER_LENGTH = struct.Struct("<H")

GENUINE, CORRUPTED, FORGED, UNKNOWN_KEY = "genuine", "corrupted", "forged", "unknown key"


class L2Unavailable(Exception):
    """L2 did not answer (down, failing over, or not acknowledging a sync write)."""


@dataclass(slots=True, frozen=True)
class L2Hit:
    key: ChunkKey
    entry: Entry
    blob: bytes


def encode_record(chunk: IncomingChunk, keyring: L2Keyring) -> bytes:
    header = encode_entry(dataclasses.replace(chunk.to_entry(now=0.0), pinned=False))  # pins stay in L1
    header_part = _HEADER_LENGTH.pack(len(header)) + header
    key_id, mac = keyring.sign(chunk.key, header_part, chunk.blob)
    return b"".join((bytes([len(key_id)]), key_id, mac, header_part, chunk.blob))  # one copy of the blob


def decode_record(key: ChunkKey, value: bytes, keyring: L2Keyring) -> tuple[L2Hit | None, str]:
    """(the chunk, GENUINE), or (None, why): CORRUPTED (truncated, bad header, blob fails its CRC-32),
    FORGED (the MAC does not match this key and content), UNKNOWN_KEY (signed with a key id not held).

    A matching MAC proves the bytes are what a daemon signed (it had checked their CRC-32), so the
    CRC-32 pass is only made to tell a bit flip from a forgery when the MAC fails."""
    if not value:
        return None, CORRUPTED
    key_id_end = 1 + value[0]
    signed_start = key_id_end + MAC_SIZE
    if len(value) < signed_start + _HEADER_LENGTH.size:
        return None, CORRUPTED
    view = memoryview(value)  # the signed part is read in place: one copy of the blob, at the end
    key_id, mac, signed_part = bytes(view[1:key_id_end]), bytes(view[key_id_end:signed_start]), view[signed_start:]
    if keyring.holds(key_id) and keyring.verify(key_id, mac, key, signed_part):
        hit = _parsed(key, signed_part, check_crc=False)
        return (hit, GENUINE) if hit is not None else (None, CORRUPTED)
    if _parsed(key, signed_part, check_crc=True) is None:
        return None, CORRUPTED
    return None, FORGED if keyring.holds(key_id) else UNKNOWN_KEY


def _parsed(key: ChunkKey, signed_part: memoryview, check_crc: bool) -> L2Hit | None:
    """The chunk in a record's signed part, or None when its header or blob length (or CRC-32) is wrong."""
    (header_length,) = _HEADER_LENGTH.unpack_from(signed_part)
    blob_start = _HEADER_LENGTH.size + header_length
    try:
        entry = decode_entry(signed_part[_HEADER_LENGTH.size:blob_start])
    except (AssertionError, struct.error, IndexError):
        return None
    blob = signed_part[blob_start:]
    if len(blob) != entry.size_bytes or (check_crc and crc32(blob) != entry.checksum):
        return None
    return L2Hit(key, entry, bytes(blob))


class RedisTier:
    """Thread-safe. Every call is one pipelined round trip (per cluster node). A failed call marks the
    tier degraded: later calls fail at once (L2Unavailable, no waiting on a dead socket) until
    `retry_interval_s` has passed, then one call tries again; redis-py reconnects on its own."""

    def __init__(self, address: L2Address, keyring: L2Keyring, wait_replicas: int = 0, timeout_s: float = 1.0,
                 retry_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 tls_files: L2TlsFiles | None = None) -> None:
        self.address = address
        self.keyring = keyring
        self._tls_files = tls_files or L2TlsFiles()
        self.wait_replicas = wait_replicas
        self._timeout_s = timeout_s
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._client: redis.Redis | RedisCluster | None = None
        self._retry_at = 0.0
        self.degraded = False
        self.num_errors = 0
        self.num_corrupted = 0
        self.num_forged = 0  # records whose MAC failed, or signed with a key id this daemon does not hold
        self.num_in_flight = 0  # calls waiting on Redis now

    def _connect(self) -> redis.Redis | RedisCluster:
        options = dict(password=self.address.password, username=self.address.username, ssl=self.address.tls,
                       socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s)
        if self.address.tls:
            options.update(self._tls_files.redis_options())
        redis_py = _redis()
        if self.address.cluster:
            nodes = [redis_py.cluster.ClusterNode(host, port) for host, port in self.address.nodes]
            return redis_py.cluster.RedisCluster(startup_nodes=nodes, cluster_error_retry_attempts=3, **options)
        (host, port), = self.address.nodes
        return redis_py.Redis(host=host, port=port, db=self.address.db, **options)

    def _call(self, operation: Callable[[redis.Redis | RedisCluster], T]) -> T:
        with self._lock:
            if self.degraded and self._clock() < self._retry_at:
                raise L2Unavailable(f"L2 {self.address.redacted()} is degraded; next try in "
                                    f"{self._retry_at - self._clock():.1f} s")
            client = self._client
            self.num_in_flight += 1
        try:
            if client is None:
                client = self._connect()  # a cluster client reads the slot map here
                with self._lock:
                    self._client = client
            result = operation(client)
        except (_redis().RedisError, OSError) as error:
            self._mark_failed(error)
            raise L2Unavailable(f"L2 {self.address.redacted()}: {error}") from error
        finally:
            with self._lock:
                self.num_in_flight -= 1
        if self.degraded:
            with self._lock:
                self.degraded = False
            logger.warning("L2 %s answers again: the tier is back", self.address.redacted())
        return result

    def _mark_failed(self, error: BaseException) -> None:
        with self._lock:
            first = not self.degraded
            self.degraded = True
            self.num_errors += 1
            self._retry_at = self._clock() + self._retry_interval_s
            if isinstance(self._client, _redis().cluster.RedisCluster) and first:
                self._client = None  # start again from the seed nodes: the slot map may be stale
        if first:  # once per outage, not once per request
            logger.warning("L2 %s failed (%s): serving from LMDB alone, retrying every %.1f s",
                           self.address.redacted(), error, self._retry_interval_s)

    def get(self, keys: Sequence[ChunkKey]) -> list[L2Hit | None]:
        """Each key's chunk; None when absent or bad (a bad record is deleted)."""
        if not keys:
            return []
        values = self._call(lambda client: _pipelined(client, [("get", CHUNK_PREFIX + key) for key in keys]))
        return self._decoded(keys, values)

    def get_with_content(self, keys: Sequence[ChunkKey], content_keys: Sequence[bytes]
                         ) -> tuple[list[L2Hit | None], list[list[ChunkKey]]]:
        """`get(keys)` and, for each content key, the keys stored with those tokens in some context,
        in one pipelined round trip. Bad records are deleted and served as None."""
        if not keys and not content_keys:
            return [], []
        commands = [("get", CHUNK_PREFIX + key) for key in keys]
        commands += [("smembers", CONTENT_PREFIX + key) for key in content_keys]
        replies = self._call(lambda client: _pipelined(client, commands))
        hits = self._decoded(keys, replies[:len(keys)])
        candidates = [sorted(ChunkKey(bytes(key)) for key in found) for found in replies[len(keys):]]
        return hits, candidates

    def sizes_with_content(self, keys: Sequence[ChunkKey], content_keys: Sequence[bytes]
                           ) -> tuple[list[int], list[list[ChunkKey]]]:
        """Each key's record length in bytes (0: absent) and, for each content key, the keys stored with
        those tokens in some context, in one pipelined round trip that moves no values: what a Lookup may
        ask while a request waits. Nothing here is verified; the values are checked when promoted."""
        if not keys and not content_keys:
            return [], []
        commands = [("strlen", CHUNK_PREFIX + key) for key in keys]
        commands += [("smembers", CONTENT_PREFIX + key) for key in content_keys]
        replies = self._call(lambda client: _pipelined(client, commands))
        candidates = [sorted(ChunkKey(bytes(key)) for key in found) for found in replies[len(keys):]]
        return [int(size) for size in replies[:len(keys)]], candidates

    def _decoded(self, keys: Sequence[ChunkKey], values: Sequence[bytes | None]) -> list[L2Hit | None]:
        """Every record checked (CRC-32, then MAC) before anyone may use it; what fails is a miss.
        Corrupted and forged records are deleted; one signed with a key id not held here is left
        (another daemon may hold that key mid-rotation) and counted as forged."""
        hits: list[L2Hit | None] = []
        bad: dict[str, list[ChunkKey]] = {CORRUPTED: [], FORGED: [], UNKNOWN_KEY: []}
        for key, value in zip(keys, values):
            hit, verdict = (None, GENUINE) if value is None else decode_record(key, bytes(value), self.keyring)
            hits.append(hit)
            if verdict != GENUINE:
                bad[verdict].append(key)
        if any(bad.values()):
            with self._lock:
                self.num_corrupted += len(bad[CORRUPTED])
                self.num_forged += len(bad[FORGED]) + len(bad[UNKNOWN_KEY])
            for verdict, why in ((CORRUPTED, "failed their CRC-32 or were truncated"),
                                 (FORGED, "failed their MAC (forged, altered or copied under another key)"),
                                 (UNKNOWN_KEY, "were signed with a key id not in --l2-key-file (left in L2)")):
                if bad[verdict]:
                    logger.error("%d L2 records %s: served as misses (%s)", len(bad[verdict]), why,
                                 ", ".join(key.hex()[:16] for key in bad[verdict][:8]))
            self.delete(bad[CORRUPTED] + bad[FORGED])
        return hits

    def put(self, chunks: Sequence[IncomingChunk], wait: bool = False, deadline_s: float = 10.0) -> None:
        """Writes the chunks (and their content and namespace sets).

        wait: returns only once `wait_replicas` replicas of every node written hold them (Redis WAIT on
        the connection that wrote), retrying through a failover for up to deadline_s; else L2Unavailable."""
        if not chunks:
            return
        commands = []
        for chunk in chunks:
            commands.append(("set", CHUNK_PREFIX + chunk.key, encode_record(chunk, self.keyring)))
            commands.append(("sadd", NAMESPACE_PREFIX + chunk.namespace, chunk.key))
            if chunk.content_key:
                commands.append(("sadd", CONTENT_PREFIX + chunk.content_key, chunk.key))
        if not wait:
            self._call(lambda client: _pipelined(client, commands))
            return
        give_up_at = self._clock() + deadline_s
        while True:
            try:
                acknowledged = self._call(lambda client: _written_with_wait(
                    client, commands, self.wait_replicas, self._timeout_s))
                if acknowledged >= self.wait_replicas:
                    return
                problem = f"{acknowledged} of {self.wait_replicas} replicas acknowledged the write"
            except L2Unavailable as error:
                problem = str(error)
            if self._clock() >= give_up_at:
                raise L2Unavailable(f"L2 did not acknowledge {len(chunks)} chunks within {deadline_s} s: {problem}")
            time.sleep(min(self._retry_interval_s, 0.25))

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Deletes the chunks; the content and namespace sets drop them lazily (a missing chunk is a miss)."""
        if not keys:
            return 0
        deleted = self._call(lambda client: _pipelined(client, [("delete", CHUNK_PREFIX + key) for key in keys]))
        return sum(deleted)

    def delete_namespace(self, namespace: bytes) -> int:
        members = self._call(lambda client: client.smembers(NAMESPACE_PREFIX + namespace))
        deleted = self.delete([ChunkKey(bytes(key)) for key in members])
        self._call(lambda client: client.delete(NAMESPACE_PREFIX + namespace))
        return deleted

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _pipelined(client: redis.Redis | RedisCluster, commands: Sequence[tuple]) -> list:
    """One round trip (per node in a cluster); the first failed command raises."""
    pipeline = client.pipeline(transaction=False)
    for name, *args in commands:
        getattr(pipeline, name)(*args)
    return pipeline.execute()


def _written_with_wait(client: redis.Redis | RedisCluster, commands: Sequence[tuple], num_replicas: int,
                       timeout_s: float) -> int:
    """Runs the commands node by node, each batch followed by WAIT on the same connection (WAIT counts
    the replicas holding what *that* connection wrote); returns the fewest replicas any node reached."""
    if isinstance(client, _redis().cluster.RedisCluster):
        by_node: dict[str, tuple[redis.Redis, list[tuple]]] = {}
        for command in commands:
            node = client.get_node_from_key(command[1])
            by_node.setdefault(node.name, (client.get_redis_connection(node), []))[1].append(command)
        batches = list(by_node.values())
    else:
        batches = [(client, list(commands))]
    acknowledged = []
    for connection, batch in batches:
        pipeline = connection.pipeline(transaction=False)
        for name, *args in batch:
            getattr(pipeline, name)(*args)
        # Half the socket timeout: Redis answers WAIT (with the count so far) before the socket gives up.
        pipeline.execute_command("WAIT", num_replicas, max(1, int(timeout_s * 500)))
        acknowledged.append(pipeline.execute()[-1])
    return min(acknowledged)
