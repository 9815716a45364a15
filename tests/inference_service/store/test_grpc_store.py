"""GrpcChunkStore against an in-process CacheService: framing, checksums, auth, deadlines, degrade and reconnect."""
from __future__ import annotations

import threading
import zlib
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest

from kvboost_common.frames import MAX_FRAME_BYTES
from inference_service.store.grpc_store import (
    GrpcStoreOptions, GrpcChunkStore, iter_store_frames, reassemble_chunks, store_deadline_s,
)
from inference_service.store.protocol import StoreItem, StoreTimeout, StoreUnavailable
from kvboost.v1 import cache_pb2, cache_pb2_grpc
from tests.conftest import pick_free_port, wait_for

NAMESPACE = b"\x01" * 32


def make_key(index: int) -> bytes:
    return bytes([index]) * 32


def make_item(index: int, blob: bytes = b"", content_key: bytes | None = None) -> StoreItem:
    return StoreItem(make_key(index), NAMESPACE, content_key, num_tokens=4, blob=blob or bytes([index]) * 100)


class FakeCacheService(cache_pb2_grpc.CacheServiceServicer):
    """A dict-backed CacheService that follows cache.proto's framing; knobs to corrupt, stall or demand a token."""

    def __init__(self, token: str | None = None) -> None:
        self.blobs: dict[bytes, bytes] = {}
        self.content: dict[bytes, bytes] = {}  # content key -> prefix key
        self.corrupt_keys: set[bytes] = set()  # served with a wrong checksum
        self.stall = threading.Event()  # set: Lookup blocks until `release` is set
        self.stall_spares_probes = False  # True: an empty Lookup (a probe) still answers (a slow tier, a live daemon)
        self.release = threading.Event()
        self.largest_stored_frame = 0
        self.num_lookups = 0
        self.num_lookups_answered = 0
        self.token = token

    def _check_token(self, context) -> None:
        if self.token is not None and dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")

    def Lookup(self, request, context):
        self.num_lookups += 1
        self._check_token(context)
        if self.stall.is_set() and (request.prefix_keys or not self.stall_spares_probes):
            self.release.wait(10)
        hits = [key in self.blobs for key in request.prefix_keys]
        run = hits.index(False) if False in hits else len(hits)
        content_hits = [
            cache_pb2.ContentHit(index=index, stored_key=self.content[content_key])
            for index, content_key in enumerate(request.content_keys)
            if not hits[index] and content_key in self.content
        ]
        self.num_lookups_answered += 1
        return cache_pb2.LookupReply(prefix_run=run, prefix_hit=hits, content_hits=content_hits)

    def Fetch(self, request, context):
        self._check_token(context)
        for key in request.keys:
            blob = self.blobs.get(key)
            if blob is None:
                yield cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=cache_pb2.ChunkMeta(key=key), found=False))
                continue
            checksum = zlib.crc32(blob) ^ (1 if key in self.corrupt_keys else 0)
            meta = cache_pb2.ChunkMeta(key=key, namespace=NAMESPACE, size_bytes=len(blob), checksum=checksum)
            yield cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=meta, found=True))
            for start in range(0, len(blob), MAX_FRAME_BYTES):
                yield cache_pb2.ChunkFrame(data=blob[start:start + MAX_FRAME_BYTES])

    def Store(self, request_iterator, context):
        self._check_token(context)
        stored = present = 0
        meta, parts = None, []
        for frame in list(request_iterator) + [None]:
            if frame is None or frame.WhichOneof("frame") == "header":
                if meta is not None:
                    blob = b"".join(parts)
                    assert zlib.crc32(blob) == meta.checksum and len(blob) == meta.size_bytes
                    present += meta.key in self.blobs
                    stored += meta.key not in self.blobs
                    self.blobs[meta.key] = blob
                    if meta.content_key:
                        self.content[meta.content_key] = meta.key
                meta, parts = (frame.header.meta if frame is not None else None), []
            else:
                self.largest_stored_frame = max(self.largest_stored_frame, len(frame.data))
                parts.append(frame.data)
        return cache_pb2.StoreReply(stored=stored, already_present=present)


class RecordingStub:
    """Wraps a CacheServiceStub and records which of its methods are called."""

    def __init__(self, stub, calls: list[str]) -> None:
        self._stub, self._calls = stub, calls

    def __getattr__(self, name):
        method = getattr(self._stub, name)

        def recorded(*args, **kwargs):
            self._calls.append(name)
            return method(*args, **kwargs)
        return recorded


@contextmanager
def running_daemon(service: FakeCacheService, port: int = 0):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    cache_pb2_grpc.add_CacheServiceServicer_to_server(service, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield f"127.0.0.1:{bound}"
    finally:
        service.release.set()
        server.stop(None).wait()


@contextmanager
def connected_cache(address: str, **options):
    cache = GrpcChunkStore(GrpcStoreOptions(address=address, **options))
    try:
        yield cache
    finally:
        cache.close()


@pytest.fixture()
def service() -> FakeCacheService:
    return FakeCacheService()


@pytest.fixture()
def cache(service):
    with running_daemon(service) as address, connected_cache(address, reconnect_interval_s=0.1) as cache:
        yield cache


# --- framing (pure) ---------------------------------------------------------------------------------

def test_store_frames_split_blobs_at_one_mebibyte() -> None:
    blob = bytes(range(256)) * (MAX_FRAME_BYTES * 5 // 2 // 256)  # 2.5 MiB
    frames = list(iter_store_frames([make_item(1, blob)]))
    # One header, then 1 MiB + 1 MiB + 0.5 MiB of data.
    assert [f.WhichOneof("frame") for f in frames] == ["header", "data", "data", "data"]
    assert [len(f.data) for f in frames[1:]] == [MAX_FRAME_BYTES, MAX_FRAME_BYTES, MAX_FRAME_BYTES // 2]
    meta = frames[0].header.meta
    assert (meta.key, meta.size_bytes, meta.checksum) == (make_key(1), len(blob), zlib.crc32(blob))


def test_reassemble_round_trips_store_frames_in_order() -> None:
    items = [make_item(1, b"a" * 10), make_item(2, b""), make_item(3, b"c" * (MAX_FRAME_BYTES + 7))]
    frames = [
        cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=frame.header.meta, found=True))
        if frame.WhichOneof("frame") == "header" else frame
        for frame in iter_store_frames(items)
    ]
    assert list(reassemble_chunks(frames, [item.key for item in items])) == [(item.key, item.blob) for item in items]


def test_reassemble_rejects_a_stream_that_breaks_the_contract() -> None:
    header = cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(
        meta=cache_pb2.ChunkMeta(key=make_key(1), size_bytes=10, checksum=zlib.crc32(b"x" * 10)), found=True))
    with pytest.raises(StoreUnavailable, match="stopped after 4 of 10 bytes"):
        list(reassemble_chunks([header, cache_pb2.ChunkFrame(data=b"xxxx")], [make_key(1)]))
    with pytest.raises(StoreUnavailable, match="belongs"):
        list(reassemble_chunks([header], [make_key(2)]))
    with pytest.raises(StoreUnavailable, match="ended"):
        list(reassemble_chunks([], [make_key(1)]))


# --- against the service ---------------------------------------------------------------------------

def test_store_then_lookup_reports_the_prefix_run_and_content_hits(cache, service) -> None:
    content = b"\xcc" * 32
    assert cache.store([make_item(1), make_item(2), make_item(9, content_key=content)]) == 3
    # Keys 1, 2 hit in a row; 3 misses and ends the run; chunk 3's content key was stored under key 9.
    result = cache.lookup(NAMESPACE, [make_key(1), make_key(2), make_key(3)], [b"\x00" * 32, b"\x00" * 32, content])
    assert result.prefix_run == 2
    assert result.content_hits == {2: make_key(9)}
    # Storing the same chunk again counts it as stored (already present).
    assert cache.store([make_item(1)]) == 1


def test_fetch_returns_blobs_in_request_order_and_none_for_misses(cache, service) -> None:
    big = bytes(range(256)) * (3 * MAX_FRAME_BYTES // 256 + 1)
    cache.store([make_item(1, big), make_item(2)])
    assert service.largest_stored_frame == MAX_FRAME_BYTES
    fetched = list(cache.fetch([make_key(2), make_key(7), make_key(1)]))
    assert fetched == [(make_key(2), make_item(2).blob), (make_key(7), None), (make_key(1), big)]
    assert list(cache.fetch([])) == []


def test_a_blob_that_fails_its_checksum_is_a_miss(cache, service) -> None:
    cache.store([make_item(1), make_item(2)])
    service.corrupt_keys.add(make_key(1))
    assert list(cache.fetch([make_key(1), make_key(2)])) == [(make_key(1), None), (make_key(2), make_item(2).blob)]
    assert not cache.degraded


def test_bearer_token_is_sent_and_a_wrong_one_degrades() -> None:
    service = FakeCacheService(token="s3cret")
    with running_daemon(service) as address:
        with connected_cache(address, auth_token="s3cret") as cache:
            assert cache.store([make_item(1)]) == 1
            assert cache.lookup(NAMESPACE, [make_key(1)]).prefix_run == 1
        with connected_cache(address, auth_token="wrong", reconnect_interval_s=0.05) as cache:
            with pytest.raises(StoreUnavailable, match="UNAUTHENTICATED"):
                cache.lookup(NAMESPACE, [make_key(1)])
            assert cache.degraded
            # Reconnect probes go through auth too: they keep failing, so the flag does not flap.
            refused = service.num_lookups
            wait_for(lambda: service.num_lookups >= refused + 3, "three reconnect probes", timeout_s=10.0, interval_s=0.02)
            assert cache.degraded


def test_a_stalled_daemon_costs_one_short_deadline(service) -> None:
    with running_daemon(service) as address, connected_cache(address, rpc_timeout_s=0.2) as cache:
        service.stall.set()
        asked, answered = service.num_lookups, service.num_lookups_answered
        with pytest.raises(StoreTimeout, match="DEADLINE_EXCEEDED"):
            cache.lookup(NAMESPACE, [make_key(1)])
        # One attempt, given up by the client's deadline while the daemon still holds it (no retry, no waiting it
        # out); then one probe, which stalls too: only that marks the daemon unreachable.
        wait_for(lambda: cache.degraded, "the probe after the slow call", timeout_s=10.0, interval_s=0.02)
        assert (service.num_lookups, service.num_lookups_answered) == (asked + 2, answered)
        service.release.set()


def test_a_slow_lookup_costs_that_request_only_when_the_daemon_answers_a_probe(service) -> None:
    """A Lookup slowed past its deadline (a busy machine, a slow L2 behind the daemon) is not an outage."""
    service.blobs[make_key(1)] = b"x"
    with running_daemon(service) as address, connected_cache(address, rpc_timeout_s=0.2) as cache:
        service.stall.set()
        service.stall_spares_probes = True
        with pytest.raises(StoreTimeout, match="DEADLINE_EXCEEDED"):
            cache.lookup(NAMESPACE, [make_key(1)])
        wait_for(lambda: cache.num_slow_call_probes == 1, "the probe after the slow call", timeout_s=10.0,
                 interval_s=0.02)
        assert not cache.degraded
        service.stall.clear()
        assert cache.lookup(NAMESPACE, [make_key(1)]).prefix_run == 1  # the next request uses the cache
        service.release.set()


def test_a_dead_daemon_degrades_fast_and_reconnect_restores_the_cache(service) -> None:
    port = pick_free_port()
    with connected_cache(f"127.0.0.1:{port}", rpc_timeout_s=0.5, reconnect_interval_s=0.1) as cache:
        assert not cache.check()  # nobody listens yet
        assert cache.degraded
        # While degraded every call fails at once, without a network round trip: the stub is never called.
        stub_calls: list[str] = []
        cache._stub = RecordingStub(cache._stub, stub_calls)
        for _ in range(20):
            with pytest.raises(StoreUnavailable, match="unreachable"):
                cache.lookup(NAMESPACE, [make_key(1)])
            with pytest.raises(StoreUnavailable):
                list(cache.fetch([make_key(1)]))
            with pytest.raises(StoreUnavailable):
                cache.store([make_item(1)])
        assert stub_calls == []
        # The daemon comes up on that port: the background probe clears the flag by itself.
        with running_daemon(service, port):
            wait_for(lambda: not cache.degraded, "reconnect", timeout_s=10.0, interval_s=0.02)
            assert cache.store([make_item(1)]) == 1
            assert cache.lookup(NAMESPACE, [make_key(1)]).prefix_run == 1
        # It goes away again: the next call degrades, and the one after fails fast.
        with pytest.raises(StoreUnavailable):
            cache.lookup(NAMESPACE, [make_key(1)])
        assert cache.degraded


def test_a_daemon_dying_mid_fetch_raises_cache_unavailable(service) -> None:
    service.blobs = {make_key(i): bytes([i]) * MAX_FRAME_BYTES for i in range(1, 65)}  # 64 MiB: more than flow control buffers
    port = pick_free_port()
    with connected_cache(f"127.0.0.1:{port}") as cache:
        with running_daemon(service, port):
            chunks = cache.fetch(list(service.blobs))
            assert next(chunks) == (make_key(1), service.blobs[make_key(1)])
        # Leaving the block stopped the daemon while the stream was half read.
        with pytest.raises(StoreUnavailable):
            list(chunks)
        assert cache.degraded


# --- against the real daemon (in-process) ------------------------------------------------------------

def test_round_trip_through_the_real_daemon(tmp_path) -> None:
    from tests.daemon_support import running_daemon as running_real_daemon

    big = bytes(range(256)) * (5 * MAX_FRAME_BYTES // 2 // 256)  # 2.5 MiB: three data frames each way
    content = b"\xcc" * 32
    with running_real_daemon(tmp_path / "lmdb") as daemon, connected_cache(daemon.address) as cache:
        assert cache.check()
        assert cache.store([make_item(1, big), make_item(2), make_item(9, content_key=content)]) == 3
        assert cache.store([make_item(1, big)]) == 1  # already present still counts
        result = cache.lookup(NAMESPACE, [make_key(1), make_key(2), make_key(3)], [b"\x00" * 32] * 2 + [content])
        assert (result.prefix_run, result.content_hits) == (2, {2: make_key(9)})
        assert list(cache.fetch([make_key(2), make_key(3), make_key(1)])) == [
            (make_key(2), make_item(2).blob), (make_key(3), None), (make_key(1), big)]
        assert not cache.degraded


def test_bearer_token_through_the_real_daemon(tmp_path) -> None:
    from tests.daemon_support import running_daemon as running_real_daemon

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with running_real_daemon(tmp_path / "lmdb", auth_token_file=token_file) as daemon:
        with connected_cache(daemon.address, auth_token="s3cret") as cache:
            assert cache.check()
            assert cache.store([make_item(1)]) == 1
        with connected_cache(daemon.address) as cache:
            with pytest.raises(StoreUnavailable, match="UNAUTHENTICATED"):
                cache.lookup(NAMESPACE, [make_key(1)])
            assert cache.degraded


# --- bounded streams ---------------------------------------------------------------------------------

class CountingStalls(FakeCacheService):
    """Counts Fetch streams; a Store waits on `store_gate` while it is cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.num_fetches = 0
        self.store_gate = threading.Event()
        self.store_gate.set()

    def Fetch(self, request, context):
        self.num_fetches += 1
        yield from super().Fetch(request, context)

    def Store(self, request_iterator, context):
        self.store_gate.wait(10)
        return super().Store(request_iterator, context)


def test_a_long_fetch_goes_out_as_streams_of_at_most_32_keys_in_order() -> None:
    service = CountingStalls()
    service.blobs = {make_key(i): bytes([i]) * 10 for i in range(70)}
    with running_daemon(service) as address, connected_cache(address) as cache:
        assert list(cache.fetch([make_key(i) for i in range(70)])) == [(make_key(i), bytes([i]) * 10)
                                                                       for i in range(70)]
    assert service.num_fetches == 3  # 32 + 32 + 6


def test_a_store_past_its_deadline_fails_alone_and_the_daemon_stays_in_use() -> None:
    service = CountingStalls()
    with running_daemon(service) as address, connected_cache(address, store_timeout_s=0.2) as cache:
        service.store_gate.clear()
        with pytest.raises(StoreTimeout, match="past its deadline"):
            cache.store([make_item(1)])
        assert not cache.degraded  # a slow write is not an outage: lookups still go to the daemon
        service.store_gate.set()
        assert cache.lookup(NAMESPACE, [make_key(1)]).prefix_run == 0
        assert cache.store([make_item(2)]) == 1


def test_a_store_deadline_grows_with_its_bytes() -> None:
    assert store_deadline_s(10.0, 0) == 10.0
    assert store_deadline_s(10.0, 160_000_000) == pytest.approx(20.0)  # 160 MB at the 16 MB/s floor
