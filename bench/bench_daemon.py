"""Fetch throughput of the cache daemon next to a bare gRPC byte stream of the same bytes, same run; and (--parts scale,
bench/daemon_scale.py) the daemon at 1e4..1e6 entries.

Both servers are processes on loopback. The bare one streams the blobs as raw 1 MiB messages (no protobuf); Fetch is
timed decoded by the generated stub and undecoded (the bare stream's client work, so the ratio is the daemon's own
cost), and with the reader verifying. Runs alternate; the servers' CPU time is reported beside wall time.

    python bench/bench_daemon.py            # ~100 MB of 1-5 MB chunks, 5 repeats
    python bench/bench_daemon.py --parts scale --entries 1e4,1e5,1e6 [--baseline-tree /tmp/base]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from kvboost.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402

from bench import harness  # noqa: E402

from tests.conftest import pick_free_port as free_port  # noqa: E402
from tests.e2e.daemon_process import start_daemon  # noqa: E402

MiB = 1 << 20
FRAME_BYTES = MiB
NAMESPACE = bytes(range(32))
BARE_METHOD = "/bench.Bare/Stream"
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 8 * MiB), ("grpc.max_send_message_length", 8 * MiB)]


def make_blobs(total_bytes: int, seed: int) -> list[bytes]:
    """Random 1-5 MB blobs adding up to about total_bytes."""
    rng = random.Random(seed)
    blobs, size = [], 0
    while size < total_bytes:
        blobs.append(rng.randbytes(rng.randint(1_000_000, 5_000_000)))
        size += len(blobs[-1])
    return blobs


def blob_key(index: int) -> bytes:
    return index.to_bytes(4, "big") * 8


def serve_bare(port: int, total_bytes: int, seed: int) -> None:
    """The baseline server: streams every blob in 1 MiB raw byte messages, nothing else."""
    pieces = [blob[start:start + FRAME_BYTES] for blob in make_blobs(total_bytes, seed)
              for start in range(0, len(blob), FRAME_BYTES)]

    async def stream(request: bytes, context):
        for piece in pieces:
            yield piece

    async def main() -> None:
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        handlers = {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bare", handlers),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def store_all(stub: cache_pb2_grpc.CacheServiceStub, blobs: list[bytes]) -> float:
    def frames():
        for index, blob in enumerate(blobs):
            meta = cache_pb2.ChunkMeta(key=blob_key(index), namespace=NAMESPACE, size_bytes=len(blob),
                                       checksum=zlib.crc32(blob), num_tokens=128)
            yield cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=meta))
            for start in range(0, len(blob), FRAME_BYTES):
                yield cache_pb2.ChunkFrame(data=blob[start:start + FRAME_BYTES])

    started = time.perf_counter()
    reply = stub.Store(frames())
    elapsed = time.perf_counter() - started
    assert reply.stored == len(blobs), f"stored {reply.stored} of {len(blobs)} chunks"
    return elapsed


def fetch_decoded(stub: cache_pb2_grpc.CacheServiceStub, keys: list[bytes], reader_verifies: bool = False) -> int:
    """Fetch as a plain client does it: every frame decoded by the generated stub."""
    request = cache_pb2.FetchRequest(keys=keys, reader_verifies=reader_verifies)
    return sum(len(frame.data) for frame in stub.Fetch(request))


def fetch_undecoded(channel: grpc.Channel, keys: list[bytes], reader_verifies: bool = False) -> int:
    """Fetch with the frames left as the bytes received: the same client work as the bare stream."""
    call = channel.unary_stream("/kvboost.v1.CacheService/Fetch",
                                request_serializer=cache_pb2.FetchRequest.SerializeToString)
    return sum(len(frame) for frame in call(cache_pb2.FetchRequest(keys=keys, reader_verifies=reader_verifies)))


def bare_stream(channel: grpc.Channel) -> int:
    return sum(len(piece) for piece in channel.unary_stream(BARE_METHOD)(b""))


def check_fetch(stub: cache_pb2_grpc.CacheServiceStub, keys: list[bytes], blobs: list[bytes]) -> None:
    """Outside the timing: the fetched blobs are bit-exact."""
    pieces: dict[bytes, list[bytes]] = {}
    current: list[bytes] = []
    for frame in stub.Fetch(cache_pb2.FetchRequest(keys=keys)):
        if frame.WhichOneof("frame") == "header":
            assert frame.header.found, "a stored chunk was not found"
            current = pieces.setdefault(frame.header.meta.key, [])
        else:
            current.append(frame.data)
    assert [b"".join(pieces[key]) for key in keys] == blobs, "fetched bytes differ from the stored ones"


def timed_transfer(server_pid: int, transfer: Callable[[], int], total: int) -> dict:
    """One transfer of every blob: MB/s at the client and the server's CPU seconds per GB moved."""
    cpu_s = lambda: harness.cpu_seconds(Path(f"/proc/{server_pid}/stat").read_text())  # noqa: E731
    cpu_before, started = cpu_s(), time.perf_counter()
    received = transfer()
    elapsed = time.perf_counter() - started
    assert received >= total, f"received {received} of {total} bytes"
    return {"mb_per_s": total / elapsed / 1e6, "server_cpu_s_per_gb": (cpu_s() - cpu_before) / total * 1e9}


def run(total_bytes: int, repeats: int, seed: int) -> None:
    blobs = make_blobs(total_bytes, seed)
    total = sum(len(blob) for blob in blobs)
    keys = [blob_key(index) for index in range(len(blobs))]
    bare_port = free_port()
    bare = subprocess.Popen([sys.executable, __file__, "--serve-bare", str(bare_port), str(total_bytes),
                             "--seed", str(seed)], stdout=subprocess.PIPE, text=True)
    with tempfile.TemporaryDirectory(prefix="kvboost-bench-") as work_dir:
        daemon = start_daemon(Path(work_dir) / "lmdb", free_port(), "--max-bytes", str(4 * total),
                              "--log-level", "WARNING")
        try:
            assert bare.stdout.readline().strip() == "ready", "the bare server did not start"
            with grpc.insecure_channel(daemon.address, options=CHANNEL_OPTIONS) as daemon_channel, \
                    grpc.insecure_channel(f"127.0.0.1:{bare_port}", options=CHANNEL_OPTIONS) as bare_channel:
                stub = cache_pb2_grpc.CacheServiceStub(daemon_channel)
                store_s = store_all(stub, blobs)
                check_fetch(stub, keys, blobs)
                transfers = {
                    "bare gRPC byte stream (1 MiB raw messages)": (bare.pid, lambda: bare_stream(bare_channel)),
                    "daemon Fetch, frames decoded by the generated stub": (
                        daemon.process.pid, lambda: fetch_decoded(stub, keys)),
                    "daemon Fetch, frames left undecoded (client work as bare)": (
                        daemon.process.pid, lambda: fetch_undecoded(daemon_channel, keys)),
                    # What the inference service asks for: it checks each blob itself, once, so the daemon doesn't.
                    "daemon Fetch, reader verifies, decoded by the stub": (
                        daemon.process.pid, lambda: fetch_decoded(stub, keys, reader_verifies=True)),
                    "daemon Fetch, reader verifies, undecoded": (
                        daemon.process.pid, lambda: fetch_undecoded(daemon_channel, keys, reader_verifies=True)),
                }
                for _, transfer in transfers.values():  # warm-up: page cache, connections, allocator
                    transfer()
                samples = harness.alternate({name: lambda pid=pid, transfer=transfer: timed_transfer(
                    pid, transfer, total) for name, (pid, transfer) in transfers.items()}, repeats)
        finally:
            daemon.terminate()
            bare.kill()
            bare.wait()
    from kvboost_common.checksum import crc32

    rows = [harness.summarize(runs, stream=name) for name, runs in samples.items()]
    rows.append({"stream": "daemon Store: one call, one transaction (reference)", "mb_per_s": total / store_s / 1e6})
    harness.print_table(f"bench_daemon fetch: {total / 1e6:.1f} MB in {len(blobs)} chunks of 1-5 MB, median of "
                        f"{repeats} alternating repeats, loopback, {os.cpu_count()} CPUs, daemon CRC-32 from "
                        f"{crc32.__module__}", rows, ["stream", ("mb_per_s", "median MB/s"),
                                                      ("server_cpu_s_per_gb", "server CPU s/GB")], digits=1)
    for row in rows[1:-1]:
        ratio = row["mb_per_s"] / rows[0]["mb_per_s"]
        print(f"{row['stream']} / bare = {ratio:.2f} ({'meets' if ratio >= 0.9 else 'misses'} the target of >= 0.9)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mb", type=float, default=100, help="bytes to move per run, in MB")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each stream (medians)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="fetch", help="comma-separated: fetch (throughput vs bare gRPC), "
                        "scale (entry counts, see --entries)")
    parser.add_argument("--entries", default="1e4,1e5,1e6", help="scale part: entry counts, e.g. 1e4,1e5,1e6")
    parser.add_argument("--stores", type=int, default=500, help="scale part: timed Stores per entry count")
    parser.add_argument("--lookups", type=int, default=2000, help="scale part: timed Lookups per phase")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="scale part: another source tree whose "
                        "daemon is measured alternately with this one's (e.g. the previous commit)")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "daemon_scale.png", help="scale part: PNG")
    parser.add_argument("--serve-bare", type=int, nargs=2, metavar=("PORT", "TOTAL_BYTES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare(*args.serve_bare, args.seed)
        return
    parts = set(args.parts.split(","))
    assert parts <= {"fetch", "scale"}, f"unknown parts: {parts - {'fetch', 'scale'}}"
    if "fetch" in parts:
        assert args.repeats >= 3, "the median needs at least 3 repeats"
        run(int(args.total_mb * 1e6), args.repeats, args.seed)
    if "scale" in parts:
        run_scale([int(float(count)) for count in args.entries.split(",")], args.stores, args.lookups, args.seed,
                  args.plot, args.baseline_tree)


def run_scale(entry_counts: list[int], num_stores: int, num_lookups: int, seed: int, plot_path: Path,
              baseline_tree: Path | None = None) -> None:
    from bench import daemon_scale

    trees = harness.trees(baseline_tree)
    empty_rss = {label: daemon_scale.empty_daemon_rss(free_port, tree) for label, tree in trees.items()}
    points: dict[str, list] = {label: [] for label in trees}
    for index, num_entries in enumerate(entry_counts):  # which tree goes first alternates with the entry count
        order = list(trees.items())[::-1 if index % 2 else 1]
        measured = harness.alternate({label: lambda label=label, tree=tree, n=num_entries: daemon_scale.measure(
            n, num_stores, num_lookups, seed, free_port, empty_rss[label], tree) for label, tree in order}, rounds=1)
        for label, (point,) in measured.items():
            points[label].append(point)
            print(f"{label}: {num_entries:,} entries: LMDB written directly through the store in {point.build_s:.1f} s",
                  flush=True)
    print(f"\n1 KiB blobs, budget exactly full (every Store of a new chunk evicts one), {num_stores} Stores, "
          f"{num_lookups} Lookups per phase, {os.cpu_count()} CPUs, daemon empty RssAnon "
          + ", ".join(f"{label} {rss / 2**20:.1f} MiB" for label, rss in empty_rss.items()))
    print(daemon_scale.table([p for label in trees for p in points[label]],
                             [label for label in trees for _ in points[label]]))
    daemon_scale.plot(points["now"], plot_path)
    print(f"plot: {plot_path}")


if __name__ == "__main__":
    main()
