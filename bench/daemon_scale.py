"""The daemon at 1e4..1e6 entries: Store with eviction, Lookup alone and beside Stores, restart, RSS per entry.

Each size's LMDB environment is written directly through cache_daemon.store, then a daemon process serves it with
--max-bytes exactly full (every Store of a new 1 KiB chunk evicts one), after 65,536 chunks Stored over the wire (the
events journal full, the continuation index in use). Timed from gRPC clients, never inside the daemon. Run through
`bench/bench_daemon.py --parts scale`.
"""
from __future__ import annotations

import multiprocessing
import random
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import grpc
from kvboost.v1 import cache_pb2, cache_pb2_grpc

from bench import harness
from cache_daemon.entry import Entry
from cache_daemon.store import LmdbStore
from tests.e2e.daemon_process import start_daemon

BLOB_BYTES = 1024
NAMESPACE = bytes(range(32))
NUM_HOT = 1000  # chunks read by Lookups (high frequency, so never the victims); at most a tenth of all
LOOKUP_KEYS = 16
BUILD_BATCH = 20_000
TOKENS_PER_CHUNK = 128
JOURNAL_FILL = 65_536  # chunks Stored over the wire first: the events journal holds its default history of them
FILL_STREAM_CHUNKS = 1024


def chunk_key(label: str, number: int) -> bytes:
    return zlib.crc32(label.encode()).to_bytes(4, "big") + number.to_bytes(28, "big")


def blob_for(key: bytes) -> bytes:
    return key * (BLOB_BYTES // len(key))


def build_environment(data_dir: Path, num_entries: int, seed: int) -> float:
    """num_entries chunks of 1 KiB with varied frequencies and last accesses; returns seconds."""
    rng, now, started = random.Random(seed), time.time(), time.perf_counter()
    store = LmdbStore(data_dir, map_size=3 * num_entries * BLOB_BYTES + (256 << 20))
    try:
        for first in range(0, num_entries, BUILD_BATCH):
            puts = []
            for number in range(first, min(num_entries, first + BUILD_BATCH)):
                key = chunk_key("stored", number)
                blob = blob_for(key)
                frequency = 100.0 if number < num_hot(num_entries) else float(rng.choice([1, 1, 1, 2, 3]))
                entry = Entry(namespace=NAMESPACE, content_key=b"", num_tokens=128, size_bytes=len(blob),
                              checksum=zlib.crc32(blob), frequency=frequency,
                              last_access=now - rng.uniform(0, 3600), slot=number)
                puts.append((key, entry, blob))
            store.write(puts=puts)
        store.sync()
    finally:
        store.close()
    return time.perf_counter() - started


def store_frames(key: bytes, parent: bytes = NAMESPACE):
    """One chunk as the service stores it: with its parent key and token ids, so the continuation index is on."""
    blob = blob_for(key)
    token_ids = b"".join((number % 50_000).to_bytes(4, "little") for number in range(TOKENS_PER_CHUNK))
    meta = cache_pb2.ChunkMeta(key=key, namespace=NAMESPACE, size_bytes=len(blob), checksum=zlib.crc32(blob),
                               num_tokens=TOKENS_PER_CHUNK, parent_key=parent, token_ids=token_ids)
    yield cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=meta))
    yield cache_pb2.ChunkFrame(data=blob)


def fill_journal(stub, count: int = JOURNAL_FILL) -> None:
    """count new chunks (each evicting one) over the wire in streams of FILL_STREAM_CHUNKS, each chained from
    the one before: the events journal then holds a full history and the continuation index as many parents."""
    for first in range(0, count, FILL_STREAM_CHUNKS):
        numbers = range(first, min(count, first + FILL_STREAM_CHUNKS))
        frames = (frame for number in numbers for frame in store_frames(
            chunk_key("fill", number), chunk_key("fill", number - 1) if number else NAMESPACE))
        reply = stub.Store(frames, timeout=120)
        assert reply.stored == len(numbers), f"fill: {reply}"


def timed_stores(stub, label: str, count: int) -> list[float]:
    """count Stores of one new chunk each (each evicts one), in ms."""
    times = []
    for number in range(count):
        started = time.perf_counter()
        reply = stub.Store(store_frames(chunk_key(label, number), chunk_key(label, number - 1) if number else NAMESPACE))
        times.append((time.perf_counter() - started) * 1e3)
        assert reply.stored == 1 and reply.evicted == 1, f"expected one stored and one evicted, got {reply}"
    return times


def num_hot(num_entries: int) -> int:
    return min(NUM_HOT, num_entries // 10)


def timed_lookups(stub, count: int, seed: int, num_entries: int) -> list[float]:
    rng = random.Random(seed)
    times = []
    for _ in range(count):
        keys = [chunk_key("stored", rng.randrange(num_hot(num_entries))) for _ in range(LOOKUP_KEYS)]
        started = time.perf_counter()
        reply = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys))
        times.append((time.perf_counter() - started) * 1e3)
        assert reply.prefix_run == LOOKUP_KEYS, f"hot chunks missing: {reply.prefix_run}"
    return times


def store_forever(address: str, label: str, stop, counter) -> None:
    """Child process: Stores one new chunk after another until told to stop."""
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        number = 0
        while not stop.is_set():
            stub.Store(store_frames(chunk_key(label, number)))
            number += 1
        counter.value = number


def wait_until_loaded(stub) -> None:
    """A Store waits for the index to load: the first one returns once it is there."""
    stub.Store(store_frames(chunk_key("warm-up", 0)))


@dataclass
class ScalePoint:
    num_entries: int
    build_s: float
    store_ms: list[float]
    lookup_ms: list[float]
    lookup_during_stores_ms: list[float]
    stores_during_lookups: int
    restart_serving_s: float
    restart_loaded_s: float
    rss_per_entry: float


def measure(num_entries: int, num_stores: int, num_lookups: int, seed: int, free_port, empty_rss: int,
            tree: Path | None = None) -> ScalePoint:
    with tempfile.TemporaryDirectory(prefix="kvboost-scale-") as work_dir:
        data_dir = Path(work_dir) / "lmdb"
        build_s = build_environment(data_dir, num_entries, seed)
        args = ("--max-bytes", str(num_entries * BLOB_BYTES), "--log-level", "WARNING")
        daemon = start_daemon(data_dir, free_port(), *args, tree=tree)
        try:
            with grpc.insecure_channel(daemon.address) as channel:
                stub = cache_pb2_grpc.CacheServiceStub(channel)
                wait_until_loaded(stub)
                fill_journal(stub)
                timed_stores(stub, "warm", 50)
                store_ms = timed_stores(stub, "timed", num_stores)
                timed_lookups(stub, 100, seed, num_entries)
                lookup_ms = timed_lookups(stub, num_lookups, seed, num_entries)
                spawn = multiprocessing.get_context("spawn")  # a forked child would share gRPC state
                stop, counter = spawn.Event(), spawn.Value("i", 0)
                writer = spawn.Process(target=store_forever, args=(daemon.address, "beside", stop, counter))
                writer.start()
                time.sleep(0.5)
                lookup_during_ms = timed_lookups(stub, num_lookups, seed + 1, num_entries)
                stop.set()
                writer.join()
                rss_per_entry = (harness.rss_bytes(daemon.process.pid, "RssAnon") - empty_rss) / num_entries
            daemon.kill()  # kill -9: the restart below reads what a crash leaves
            started = time.perf_counter()
            daemon = start_daemon(data_dir, free_port(), *args, tree=tree)
            restart_serving_s = time.perf_counter() - started
            with grpc.insecure_channel(daemon.address) as channel:
                wait_until_loaded(cache_pb2_grpc.CacheServiceStub(channel))
            restart_loaded_s = time.perf_counter() - started
        finally:
            daemon.kill()
    return ScalePoint(num_entries, build_s, store_ms, lookup_ms, lookup_during_ms, counter.value, restart_serving_s,
                      restart_loaded_s, rss_per_entry)


def empty_daemon_rss(free_port, tree: Path | None = None) -> int:
    """RssAnon of a daemon over an empty environment, after one Store: the baseline per-entry RSS is above."""
    with tempfile.TemporaryDirectory(prefix="kvboost-scale-") as work_dir:
        daemon = start_daemon(Path(work_dir) / "lmdb", free_port(), "--log-level", "WARNING", tree=tree)
        try:
            with grpc.insecure_channel(daemon.address) as channel:
                stub = cache_pb2_grpc.CacheServiceStub(channel)
                stub.Store(store_frames(chunk_key("empty", 0)))
                stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[chunk_key("empty", 0)]))
            return harness.rss_bytes(daemon.process.pid, "RssAnon")
        finally:
            daemon.kill()


def table(points: list[ScalePoint], labels: list[str]) -> str:
    p50, p99 = harness.median, lambda values: harness.percentile(values, 0.99)
    rows = [{"tree": label, "entries": f"{p.num_entries:,}", "store_p50": p50(p.store_ms), "store_p99": p99(p.store_ms),
             "lookup_p50": p50(p.lookup_ms), "lookup_p99": p99(p.lookup_ms),
             "beside_p50": p50(p.lookup_during_stores_ms), "beside_p99": p99(p.lookup_during_stores_ms),
             "stores_per_s": f"{p.stores_during_lookups / (sum(p.lookup_during_stores_ms) / 1e3):.0f}",
             "restart_s": p.restart_serving_s, "loaded_s": p.restart_loaded_s, "rss": f"{p.rss_per_entry:.0f} B"}
            for label, p in zip(labels, points)]
    return harness.table(rows, ["tree", "entries", ("store_p50", "Store+evict p50 ms"), ("store_p99", "p99"),
                                ("lookup_p50", "Lookup(16) p50 ms"), ("lookup_p99", "p99"),
                                ("beside_p50", "Lookup p50 beside Stores"), ("beside_p99", "p99"),
                                ("stores_per_s", "Stores/s beside"), ("restart_s", "restart to SERVING s"),
                                ("loaded_s", "to index loaded s"), ("rss", "RSS/entry")])


def plot(points: list[ScalePoint], path: Path) -> None:
    plt = harness.pyplot()
    sizes = [p.num_entries for p in points]
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [
        ("Store with eviction (ms)", [("p50", [harness.median(p.store_ms) for p in points]),
                                      ("p99", [harness.percentile(p.store_ms, 0.99) for p in points])], 5.0),
        ("Lookup of 16 keys (ms)", [("p99 alone", [harness.percentile(p.lookup_ms, 0.99) for p in points]),
                                    ("p99 beside Stores", [harness.percentile(p.lookup_during_stores_ms, 0.99)
                                                           for p in points])], 2.0),
        ("restart after kill -9 (s)", [("to SERVING", [p.restart_serving_s for p in points]),
                                       ("to index loaded", [p.restart_loaded_s for p in points])], 2.0),
        ("RSS per entry (bytes)", [("RssAnon / entries", [p.rss_per_entry for p in points])], 200.0),
    ]
    for axis, (title, series, target) in zip(axes, panels):
        for label, values in series:
            axis.plot(sizes, values, marker="o", label=label)
        axis.axhline(target, color="grey", linestyle="--", label=f"target {target:g}")
        axis.set_xscale("log")
        axis.set_xlabel("entries")
        axis.set_title(title)
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
