"""Test helpers for the cache daemon: chunk factories, Store/Fetch over a sync stub, an in-thread daemon."""
from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import grpc
from kvboost.v1 import cache_pb2, cache_pb2_grpc

NAMESPACE = hashlib.sha256(b"test namespace").digest()
FRAME_BYTES = 1 << 20


def digest(label: str | int) -> bytes:
    return hashlib.sha256(str(label).encode()).digest()


@dataclass(slots=True, frozen=True)
class SampleChunk:
    key: bytes
    blob: bytes
    namespace: bytes = NAMESPACE
    content_key: bytes = b""
    num_tokens: int = 16
    pinned: bool = False

    @property
    def checksum(self) -> int:
        return zlib.crc32(self.blob)


def make_chunk(label: str | int, size_bytes: int = 1000, **fields) -> SampleChunk:
    """A chunk keyed by sha256(label) with size_bytes of bytes seeded by the label."""
    blob = random.Random(str(label)).randbytes(size_bytes)
    return SampleChunk(key=digest(label), blob=blob, **fields)


def header_frame(chunk: SampleChunk, **overrides) -> cache_pb2.ChunkFrame:
    fields = dict(key=chunk.key, namespace=chunk.namespace, content_key=chunk.content_key,
                  num_tokens=chunk.num_tokens, size_bytes=len(chunk.blob), checksum=chunk.checksum,
                  pinned=chunk.pinned)
    fields.update(overrides)
    return cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=cache_pb2.ChunkMeta(**fields)))


def store_frames(chunks: Sequence[SampleChunk], frame_bytes: int = FRAME_BYTES,
                 **meta) -> list[cache_pb2.ChunkFrame]:
    """Each chunk's header (with `meta`'s ChunkMeta fields, e.g. a delete epoch), then its data frames."""
    frames = []
    for chunk in chunks:
        frames.append(header_frame(chunk, **meta))
        frames.extend(cache_pb2.ChunkFrame(data=chunk.blob[start:start + frame_bytes])
                      for start in range(0, len(chunk.blob), frame_bytes))
    return frames


@dataclass(slots=True, frozen=True)
class FetchedChunk:
    meta: cache_pb2.ChunkMeta
    found: bool
    blob: bytes | None
    num_data_frames: int


def fetch_chunks(stub: cache_pb2_grpc.CacheServiceStub, keys: Sequence[bytes], **call_options) -> list[FetchedChunk]:
    """Fetch, checking the stream's shape: one header per key in order, then frames adding up to size."""
    fetched: list[FetchedChunk] = []
    pieces: list[bytes] = []
    for frame in stub.Fetch(cache_pb2.FetchRequest(keys=keys), **call_options):
        if frame.WhichOneof("frame") == "header":
            _finish(fetched, pieces)
            header = frame.header
            fetched.append(FetchedChunk(header.meta, header.found, None, 0))
            pieces = []
        else:
            assert fetched and fetched[-1].found, "a data frame must follow the header of a found chunk"
            assert len(frame.data) <= FRAME_BYTES, f"data frame of {len(frame.data)} bytes"
            pieces.append(frame.data)
    _finish(fetched, pieces)
    assert [chunk.meta.key for chunk in fetched] == list(keys), "one header per requested key, in order"
    return fetched


def _finish(fetched: list[FetchedChunk], pieces: list[bytes]) -> None:
    if fetched and fetched[-1].found:
        last = fetched[-1]
        blob = b"".join(pieces)
        assert len(blob) == last.meta.size_bytes, f"{len(blob)} data bytes for size_bytes={last.meta.size_bytes}"
        assert zlib.crc32(blob) == last.meta.checksum, "fetched blob fails its checksum"
        fetched[-1] = FetchedChunk(last.meta, True, blob, len(pieces))


def store_chunks(stub: cache_pb2_grpc.CacheServiceStub, chunks: Sequence[SampleChunk],
                 **call_options) -> cache_pb2.StoreReply:
    return stub.Store(iter(store_frames(chunks)), **call_options)


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    """The RpcError that call(*args) raises (streams are drained first)."""
    try:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not hasattr(result, "SerializeToString"):
            list(result)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"{call} did not fail")


TEST_L2_KEY = "test-k1 " + "5a" * 32


def shared_l2_key_file(folder: Path, text: str = TEST_L2_KEY) -> Path:
    """One L2 key file in folder, shared by every daemon started beside it (as in a real deployment)."""
    path = folder / "l2.key"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        path.chmod(0o600)
    return path


@contextmanager
def running_daemon(data_dir: Path, max_bytes: int = 1 << 30, **config_fields) -> Iterator[object]:
    """A CacheDaemon on a free loopback port, served by an event loop in a thread; stopped on exit."""
    from cache_daemon.config import DaemonConfig
    from cache_daemon.server import CacheDaemon

    if config_fields.get("l2") and "l2_key_file" not in config_fields:
        config_fields["l2_key_file"] = shared_l2_key_file(data_dir.parent)
    config = DaemonConfig(data_dir=data_dir, listen="127.0.0.1:0", max_bytes=max_bytes, **config_fields)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    daemon = asyncio.run_coroutine_threadsafe(CacheDaemon.start(config), loop).result(timeout=30)
    try:
        yield daemon
    finally:
        asyncio.run_coroutine_threadsafe(daemon.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


@contextmanager
def cache_stub(address: str, **channel_kwargs) -> Iterator[cache_pb2_grpc.CacheServiceStub]:
    with grpc.insecure_channel(address, **channel_kwargs) as channel:
        yield cache_pb2_grpc.CacheServiceStub(channel)


def hold_key_deletes(daemon) -> tuple[threading.Event, threading.Event]:
    """(removing, finish): the daemon's Deletes by keys, once begun, wait for `finish` (at most 10 s) before they
    remove anything; `removing` is set when one does."""
    removing, finish = threading.Event(), threading.Event()
    delete_keys = daemon.cache.delete_keys

    def held_delete(*args):
        removing.set()
        finish.wait(10)
        return delete_keys(*args)

    daemon.cache.delete_keys = held_delete
    return removing, finish
