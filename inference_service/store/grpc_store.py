"""GrpcChunkStore: the engine's ChunkStore over the cache daemon's CacheService, degrading when it is down."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Iterator

import grpc

from inference_service.store.chunk_frames import iter_store_frames, reassemble_chunks
from inference_service.store.protocol import (
    AfterRun, ContinuationQuery, DeleteEpoch, StoreItem, StoreLookup, StoreTimeout, StoreUnavailable, lookup_order,
)
from kvboost_common.frames import MAX_FRAME_BYTES
from kvboost.v1 import cache_pb2, cache_pb2_grpc

logger = logging.getLogger(__name__)

__all__ = ["GrpcChunkStore", "GrpcStoreOptions", "iter_store_frames", "reassemble_chunks", "store_deadline_s"]

_PROBE = cache_pb2.LookupRequest(namespace=bytes(32))
# The slowest rate a Fetch or Store stream's deadline allows for, beyond its fixed part: a stream of B bytes gets
# stream_timeout_s + B / this. A large write is slow, not an outage.
STREAM_FLOOR_BYTES_PER_S = 16e6
# Keys per Fetch stream: a long prompt's chunks come over several streams, each with its own deadline.
FETCH_BATCH_KEYS = 32
# Codes that say the daemon cannot serve us at all: stop asking until a probe answers. A call that runs past its
# deadline is not one of them (a slow tier or a large transfer degrades that request only): a probe decides.
_UNREACHABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
})


@dataclass(slots=True, frozen=True)
class GrpcStoreOptions:
    address: str = "127.0.0.1:50052"
    auth_token: str | None = None  # sent as `authorization: Bearer <token>`
    tls: bool = False
    tls_root_certificates: bytes | None = None  # PEM; None = the system roots
    rpc_timeout_s: float = 1.0  # Lookup and reconnect probes
    fetch_timeout_s: float = 10.0  # a Fetch stream of at most FETCH_BATCH_KEYS keys
    store_timeout_s: float = 10.0  # a Store stream's fixed part; plus its bytes / STREAM_FLOOR_BYTES_PER_S
    reconnect_interval_s: float = 1.0  # at most one probe per interval while degraded

    def __post_init__(self) -> None:
        assert self.address, "the cache daemon address is empty"
        for name in ("rpc_timeout_s", "fetch_timeout_s", "store_timeout_s", "reconnect_interval_s"):
            assert getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}"


class GrpcChunkStore:
    """A ChunkStore backed by the daemon.

    While the daemon is unreachable `degraded` is True and every call raises StoreUnavailable at
    once, without touching the network; a background thread probes a fresh channel at most once
    per `reconnect_interval_s` and clears `degraded` when the daemon answers.
    """

    # fetch() checks every blob against the CRC-32 the daemon stored with it, so the engine skips its own.
    verifies_blobs = True

    def __init__(self, options: GrpcStoreOptions) -> None:
        self.options = options
        self.degraded = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reconnector: threading.Thread | None = None
        self._slow_call_probe: threading.Thread | None = None
        self.num_slow_call_probes = 0  # probes run after a call ran past its deadline (answered or not)
        self._metadata = (("authorization", f"Bearer {options.auth_token}"),) if options.auth_token else ()
        self._channel = self._open_channel()
        self._stub = cache_pb2_grpc.CacheServiceStub(self._channel)

    @property
    def address(self) -> str:
        return self.options.address

    @property
    def read_mode(self) -> str:
        """"remote": every blob comes over Fetch (local reads off, or the daemon on another host)."""
        return "remote"

    def lookup(self, namespace: bytes, prefix_keys: list[bytes], content_keys: list[bytes] | None = None,
               partial_keys: list[bytes] | None = None, continuation: ContinuationQuery | None = None,
               after_run: AfterRun | None = None) -> StoreLookup:
        request = cache_pb2.LookupRequest(namespace=namespace, prefix_keys=prefix_keys, content_keys=content_keys or [],
                                          partial_keys=partial_keys or [],
                                          continue_after_run=after_run.tokens_after if after_run else ())
        if continuation is not None and continuation.token_ids:
            request.continue_parent, request.continue_tokens = continuation.parent, continuation.packed()
        stub = self._available_stub()
        asked = lookup_order()
        try:
            reply = stub.Lookup(request, timeout=self.options.rpc_timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise self._failure("Lookup", error) from error
        partial = reply.partial_index if reply.HasField("partial_index") else None
        # An older daemon leaves the continuation fields unset: reuse then stops at exact partial chunks.
        found = bool(reply.continuation_key) and reply.continuation_tokens > 0
        partial_found = bool(reply.partial_key) and reply.partial_tokens > 0
        return StoreLookup(reply.prefix_run, {hit.index: hit.stored_key for hit in reply.content_hits}, partial,
                           reply.continuation_key if found else None, reply.continuation_tokens if found else 0,
                           continued=reply.continued, partial_key=reply.partial_key if partial_found else None,
                           partial_tokens=reply.partial_tokens if partial_found else 0,
                           delete_epoch=DeleteEpoch(reply.delete_epoch_id, reply.delete_count, asked)
                           if reply.delete_epoch_id else None)

    def fetch(self, keys: list[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
        keys = list(keys)
        if not keys:
            return iter(())
        stub = self._available_stub()  # raises now, before the reader starts, when the daemon is out of reach
        return self._read_fetches(stub, keys)

    def _read_fetches(self, stub, keys: list[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
        """One Fetch stream per FETCH_BATCH_KEYS keys, each opened when the reader reaches it."""
        for start in range(0, len(keys), FETCH_BATCH_KEYS):
            batch = keys[start:start + FETCH_BATCH_KEYS]
            # The stream's bytes are checked here, once (reader_verifies): the daemon skips its own check.
            call = (stub if start == 0 else self._available_stub()).Fetch(
                cache_pb2.FetchRequest(keys=batch, reader_verifies=True), timeout=self.options.fetch_timeout_s,
                metadata=self._metadata)
            yield from self._read_fetch(call, batch)

    def _read_fetch(self, call, keys: list[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
        try:
            yield from reassemble_chunks(call, keys, on_corrupt=lambda key: self.report_corrupt([key]))
        except grpc.RpcError as error:
            raise self._failure("Fetch", error) from error
        finally:
            call.cancel()  # a no-op once the stream ended; frees it when the reader stops early

    def store(self, items: list[StoreItem]) -> int:
        if not items:
            return 0
        stub = self._available_stub()
        timeout = store_deadline_s(self.options.store_timeout_s, sum(len(item.blob) for item in items))
        try:
            reply = stub.Store(iter_store_frames(items), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise self._failure("Store", error) from error
        if reply.superseded:
            logger.info("the daemon left out %d of %d chunks: a Delete after the Lookup they were computed after "
                        "named them", reply.superseded, len(items))
        return reply.stored + reply.already_present

    def unpin(self, keys: list[bytes]) -> int:
        if not keys:
            return 0
        stub = self._available_stub()
        try:
            reply = stub.Unpin(cache_pb2.PinRequest(keys=keys), timeout=self.options.rpc_timeout_s,
                               metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:  # none of the keys is stored
                return 0
            raise self._failure("Unpin", error) from error
        return reply.updated

    def describe(self) -> cache_pb2.DescribeReply:
        """Where the daemon keeps its environment (for co-located reads). Raises StoreUnavailable."""
        stub = self._available_stub()
        try:
            return stub.Describe(cache_pb2.DescribeRequest(), timeout=self.options.rpc_timeout_s,
                                 metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.PERMISSION_DENIED:
                # A tenant's token on a daemon with tenants: co-located reads are for admins. The daemon
                # serves this service fine, so it is not degraded: blobs come over the Fetch stream.
                raise StoreUnavailable(f"the daemon refuses Describe to this token: {error.details()}") from error
            raise self._failure("Describe", error) from error

    def report_corrupt(self, keys: list[bytes]) -> None:
        """Tells the daemon these blobs failed their checksum here: it deletes and counts them. Best effort."""
        try:
            self._available_stub().Delete(cache_pb2.DeleteRequest(keys=keys, corrupted=True),
                                          timeout=self.options.rpc_timeout_s, metadata=self._metadata)
        except (grpc.RpcError, StoreUnavailable) as error:
            logger.warning("could not report %d corrupt blobs to the daemon: %s", len(keys), error)

    def check(self) -> bool:
        """Probes the daemon once now (start-up); degrades and starts reconnecting when it does not answer."""
        if self._probe(self._channel):
            return True
        self._mark_degraded("no answer to a health probe")
        return False

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._channel.close()

    # -- connection state -------------------------------------------------------------------------

    def _available_stub(self) -> cache_pb2_grpc.CacheServiceStub:
        with self._lock:
            if self.degraded:
                raise StoreUnavailable(f"cache daemon at {self.address} is unreachable; reconnecting in the background")
            return self._stub

    def _failure(self, method: str, error: grpc.RpcError) -> StoreUnavailable:
        code, details = error.code(), error.details()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            # One slow call (a busy machine, a slow L2 behind the daemon, a large transfer) costs this request
            # the cache, not every request: only a daemon that does not answer a probe is marked unreachable.
            logger.warning("cache daemon %s: %s ran past its deadline (this request goes on without the rest of "
                           "it; probing the daemon): %s", self.address, method, details)
            self._probe_in_background(method)
            return StoreTimeout(f"cache daemon {method} ran past its deadline ({code.name}): {details}")
        if code in _UNREACHABLE_CODES:
            self._mark_degraded(f"{method}: {code.name} {details}")
        else:
            logger.error("cache daemon %s refused %s: %s %s", self.address, method, code.name, details)
        return StoreUnavailable(f"cache daemon {method} failed: {code.name}: {details}")

    def _probe_in_background(self, method: str) -> None:
        """One probe at a time on the current channel; degrades only when the daemon does not answer it."""
        with self._lock:
            if self.degraded or self._closed.is_set() or self._slow_call_probe is not None:
                return
            self._slow_call_probe = threading.Thread(target=self._probe_after_slow_call, args=(method,),
                                                     name="cache-probe", daemon=True)
            self._slow_call_probe.start()

    def _probe_after_slow_call(self, method: str) -> None:
        try:
            if not self._probe(self._channel):
                self._mark_degraded(f"{method} ran past its deadline and a probe got no answer")
        finally:
            with self._lock:
                self._slow_call_probe = None
            self.num_slow_call_probes += 1

    def _mark_degraded(self, reason: str) -> None:
        with self._lock:
            if self.degraded or self._closed.is_set():
                return
            self.degraded = True
            self._reconnector = threading.Thread(target=self._reconnect_loop, name="cache-reconnect", daemon=True)
            self._reconnector.start()
        logger.warning("cache daemon at %s unreachable (%s): serving without the cache", self.address, reason)

    def _reconnect_loop(self) -> None:
        # A fresh channel per probe connects at once, instead of waiting out the old channel's backoff.
        while not self._closed.wait(self.options.reconnect_interval_s):
            channel = self._open_channel()
            if not self._probe(channel):
                channel.close()
                continue
            with self._lock:
                old, self._channel = self._channel, channel
                self._stub = cache_pb2_grpc.CacheServiceStub(channel)
                self.degraded = False
            old.close()
            logger.info("cache daemon at %s answers again: cache reuse resumed", self.address)
            return

    def _probe(self, channel: grpc.Channel) -> bool:
        """An empty Lookup: cheap, touches no entry, and goes through the daemon's auth like real calls."""
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        try:
            stub.Lookup(_PROBE, timeout=self.options.rpc_timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            return error.code() not in _UNREACHABLE_CODES
        return True

    def _open_channel(self) -> grpc.Channel:
        options = [
            ("grpc.max_receive_message_length", 4 * MAX_FRAME_BYTES),
            ("grpc.max_send_message_length", 4 * MAX_FRAME_BYTES),
        ]
        if not self.options.tls:
            return grpc.insecure_channel(self.address, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.options.tls_root_certificates)
        return grpc.secure_channel(self.address, credentials, options=options)


def store_deadline_s(fixed_s: float, num_bytes: int) -> float:
    """A Store stream's deadline: its fixed part plus its bytes at the slowest rate allowed for."""
    return fixed_s + num_bytes / STREAM_FLOOR_BYTES_PER_S
