"""Property-based bad input against an in-process daemon: every call ends with a documented status, the daemon keeps
serving, and chunks stored before the fuzzing are unchanged afterwards."""
from __future__ import annotations

import zlib

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvboost.v1 import cache_pb2, cache_pb2_grpc

from tests.daemon_support import fetch_chunks, make_chunk, running_daemon, store_chunks

MAX_EXAMPLES = 150  # per test; the module runs in well under 60 s
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED}
FRAME_LIMIT = 1 << 20
BUDGET = 256 << 20
FUZZ_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Chunks stored (pinned, in their own namespace) before any fuzzing; checked bit for bit at the end.
KEEP_NAMESPACE = bytes(range(32))
KEEP = [make_chunk(f"kept {i}", size, namespace=KEEP_NAMESPACE, pinned=True)
        for i, size in enumerate([1, 1000, FRAME_LIMIT, FRAME_LIMIT + 1, 3 * FRAME_LIMIT + 17])]

seen_codes: dict[str, set[grpc.StatusCode]] = {}


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("fuzz") / "lmdb", max_bytes=BUDGET) as daemon:
        with grpc.insecure_channel(daemon.address) as channel:
            daemon_stub = cache_pb2_grpc.CacheServiceStub(channel)
            assert store_chunks(daemon_stub, KEEP, timeout=30).stored == len(KEEP)
            yield daemon_stub
            # After all the fuzzing: the daemon serves, and the kept chunks are bit-exact.
            fetched = fetch_chunks(daemon_stub, [chunk.key for chunk in KEEP], timeout=30)
            assert [got.blob for got in fetched] == [chunk.blob for chunk in KEEP], "kept chunks changed"
            stats = daemon_stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10)
            assert stats.corrupted == 0 and stats.bytes <= BUDGET
            print("\nstatus codes seen per RPC:", {rpc: sorted(code.name for code in codes)
                                                  for rpc, codes in sorted(seen_codes.items())})


def call(rpc: str, function, *args) -> grpc.StatusCode:
    try:
        result = function(*args, timeout=30)
        if rpc == "Fetch":
            list(result)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
        assert code in DOCUMENTED, f"{rpc}: undocumented status {code}: {error.details()}"
        assert error.details(), f"{rpc}: {code} without a message"
    seen_codes.setdefault(rpc, set()).add(code)
    return code


# Digests: mostly wrong lengths, sometimes right, sometimes a kept key (reads of it must stay harmless).
digests = st.one_of(st.binary(min_size=0, max_size=40), st.binary(min_size=32, max_size=32),
                    st.sampled_from([b"", bytes(31), bytes(33), bytes(32)]))
key_lists = st.lists(digests, max_size=8)


@FUZZ_SETTINGS
@given(namespace=digests, prefix_keys=key_lists, content_keys=key_lists)
def test_lookup(stub, namespace, prefix_keys, content_keys) -> None:
    call("Lookup", stub.Lookup, cache_pb2.LookupRequest(namespace=namespace, prefix_keys=prefix_keys,
                                                       content_keys=content_keys))


@FUZZ_SETTINGS
@given(keys=st.lists(st.one_of(digests, st.sampled_from([chunk.key for chunk in KEEP])), max_size=8))
def test_fetch(stub, keys) -> None:
    code = call("Fetch", lambda request, timeout: fetch_chunks(stub, request.keys, timeout=timeout),
                cache_pb2.FetchRequest(keys=keys))
    if all(len(key) == 32 for key in keys):
        assert code == grpc.StatusCode.OK


@FUZZ_SETTINGS
@given(keys=key_lists, namespace=st.one_of(st.just(b""), digests))
def test_delete(stub, keys, namespace) -> None:
    keys = [key for key in keys if key not in {chunk.key for chunk in KEEP}]
    namespace = b"" if namespace == KEEP_NAMESPACE else namespace
    call("Delete", stub.Delete, cache_pb2.DeleteRequest(keys=keys, namespace=namespace))


@FUZZ_SETTINGS
@given(keys=key_lists, pin=st.booleans())
def test_pin_unpin(stub, keys, pin) -> None:
    keys = [key for key in keys if key not in {chunk.key for chunk in KEEP}]
    call("Pin" if pin else "Unpin", stub.Pin if pin else stub.Unpin, cache_pb2.PinRequest(keys=keys))


def header(key: bytes, namespace: bytes, size: int, checksum: int, content_key: bytes = b"",
           pinned: bool = False) -> cache_pb2.ChunkFrame:
    return cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=cache_pb2.ChunkMeta(
        key=key, namespace=namespace, content_key=content_key, size_bytes=size, checksum=checksum,
        num_tokens=16, pinned=pinned)))


def data(piece: bytes) -> cache_pb2.ChunkFrame:
    return cache_pb2.ChunkFrame(data=piece)


@st.composite
def chunk_frames(draw) -> tuple[str, bytes, list[cache_pb2.ChunkFrame]]:
    """(defect, key, frames): one chunk's frames, well formed ("none") or with one defect: a size lie, a checksum
    lie, a bad digest, a frame over the 1 MiB limit, a truncated or an over-long body, an empty frame."""
    blob = draw(st.binary(min_size=0, max_size=3000))
    key = draw(st.binary(min_size=32, max_size=32))
    namespace = draw(st.binary(min_size=32, max_size=32))
    size, checksum, content_key = len(blob), zlib.crc32(blob), b""
    pieces = [blob[i:i + 1000] for i in range(0, len(blob), 1000)]
    defect = draw(st.sampled_from(["none", "size_small", "size_large", "size_huge", "checksum", "key", "namespace",
                                   "content_key", "big_frame", "truncated", "extra_data", "empty_frame"]))
    if defect == "size_small":
        size = draw(st.integers(0, max(0, len(blob) - 1)))
    elif defect == "size_large":
        size = len(blob) + draw(st.integers(1, 5000))
    elif defect == "size_huge":
        size = draw(st.sampled_from([BUDGET + 1, 1 << 40, (1 << 64) - 1]))
    elif defect == "checksum":
        checksum = (checksum + draw(st.integers(1, 1 << 31))) % (1 << 32)
    elif defect == "key":
        key = draw(digests.filter(lambda value: len(value) != 32))
    elif defect == "namespace":
        namespace = draw(digests.filter(lambda value: len(value) != 32))
    elif defect == "content_key":
        content_key = draw(st.binary(min_size=1, max_size=40).filter(lambda value: len(value) != 32))
    elif defect == "big_frame":
        big = bytes(FRAME_LIMIT + draw(st.integers(1, 100)))
        size, checksum, pieces = len(big), zlib.crc32(big), [big]
    elif defect == "truncated":
        if not pieces:  # an empty body has nothing to cut: lie about its size instead
            size = 1
        pieces = pieces[:-1]
    elif defect == "extra_data":
        pieces = pieces + [draw(st.binary(min_size=1, max_size=100))]
    frames = [header(key, namespace, size, checksum, content_key, pinned=draw(st.booleans()))]
    frames += [data(piece) for piece in pieces]
    if defect == "empty_frame":
        frames.append(cache_pb2.ChunkFrame())
    return defect, key, frames


def present(stub, keys: list[bytes]) -> set[bytes]:
    keys = [key for key in keys if len(key) == 32]
    return {chunk.meta.key for chunk in fetch_chunks(stub, keys, timeout=30) if chunk.found} if keys else set()


@FUZZ_SETTINGS
@given(chunks=st.lists(chunk_frames(), min_size=0, max_size=4), shuffle=st.randoms(use_true_random=False),
       reorder=st.sampled_from(["keep", "shuffle", "data_first", "drop_header"]))
def test_store(stub, chunks, shuffle, reorder) -> None:
    """A Store with any defect gets a non-OK status and stores none of its chunks; a clean one stores all."""
    frames = [frame for _, _, chunk in chunks for frame in chunk]
    if reorder == "shuffle":
        shuffle.shuffle(frames)
    elif reorder == "data_first":
        frames = [data(b"data before any header")] + frames
    elif reorder == "drop_header" and frames:
        frames = frames[1:]
    keys = [key for _, key, _ in chunks]
    before = present(stub, keys)

    code = call("Store", stub.Store, iter(frames))

    defective = any(defect != "none" for defect, _, _ in chunks) or reorder in ("data_first", "drop_header") and frames
    if reorder == "keep" or reorder == "data_first":
        assert (code != grpc.StatusCode.OK) == bool(defective), f"{code} for defects {[d for d, _, _ in chunks]}"
    if code != grpc.StatusCode.OK:
        assert present(stub, keys) == before, "a refused Store left some of its chunks behind"
    elif not defective and reorder == "keep":
        assert present(stub, keys) == {key for key in keys}


@FUZZ_SETTINGS
@given(frames=st.lists(st.one_of(
    st.builds(header, digests, digests, st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 32) - 1), digests),
    st.builds(data, st.binary(max_size=2000)),
    st.just(cache_pb2.ChunkFrame()),
), max_size=8))
def test_store_random_frames(stub, frames) -> None:
    call("Store", stub.Store, iter(frames))


def test_daemon_still_serves_stats(stub) -> None:
    stats = stub.Stats(cache_pb2.CacheStatsRequest(namespace=KEEP_NAMESPACE), timeout=10)
    [kept] = stats.namespaces
    assert kept.entries == len(KEEP) and kept.pinned == len(KEEP)
