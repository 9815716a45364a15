"""The daemon's peak RSS under a flood of oversized Store streams, with and without --max-store-bytes.

A real daemon (--max-bytes 4G); N client threads each send one Store stream of M chunks of 1 MiB at once.
Without a stream bound (--max-store-bytes 0 = the budget) every stream is held whole until it ends; with
one, a stream is refused (RESOURCE_EXHAUSTED) at the chunk that would pass it. VmHWM (peak RSS) of the
daemon process is read from /proc after each run.

    flock /tmp/kvboost-bench.lock python bench/bench_store_bounds.py
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from kvboost.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402

from tests.conftest import pick_free_port  # noqa: E402
from tests.e2e.daemon_process import start_daemon  # noqa: E402

CHUNK_BYTES = 1 << 20
FRAME_BYTES = 1 << 20
NAMESPACE = hashlib.sha256(b"bench store bounds").digest()


def stream(client: int, num_chunks: int):
    blob = bytes([client]) * CHUNK_BYTES
    checksum = zlib.crc32(blob)
    for index in range(num_chunks):
        key = hashlib.sha256(f"{client}/{index}".encode()).digest()
        meta = cache_pb2.ChunkMeta(key=key, namespace=NAMESPACE, num_tokens=128, size_bytes=len(blob), checksum=checksum)
        yield cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=meta))
        yield cache_pb2.ChunkFrame(data=blob)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def flood(address: str, num_clients: int, num_chunks: int) -> list[str]:
    def one(client: int) -> str:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
            try:
                reply = cache_pb2_grpc.CacheServiceStub(channel).Store(stream(client, num_chunks), timeout=300)
                return f"stored {reply.stored}"
            except grpc.RpcError as error:
                return error.code().name
    with ThreadPoolExecutor(num_clients) as pool:
        return list(pool.map(one, range(num_clients)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=96, help="1 MiB chunks per stream")
    parser.add_argument("--bound", default="16M", help="--max-store-bytes of the bounded run")
    args = parser.parse_args()
    print(f"{args.clients} concurrent Store streams of {args.chunks} x 1 MiB; daemon --max-bytes 4G")
    print("| --max-store-bytes | outcomes | daemon peak RSS (VmHWM) |\n|---|---|---|")
    for bound in ("0", args.bound):
        with tempfile.TemporaryDirectory() as workdir:
            daemon = start_daemon(Path(workdir) / "lmdb", pick_free_port(), "--max-bytes", "4G",
                                  "--max-store-bytes", bound, "--heap-trim-interval", "0")
            try:
                outcomes = flood(daemon.address, args.clients, args.chunks)
                peak = peak_rss_mib(daemon.process.pid)
            finally:
                daemon.terminate()
        summary = ", ".join(f"{outcomes.count(kind)} x {kind}" for kind in sorted(set(outcomes)))
        print(f"| {bound} {'(= --max-bytes)' if bound == '0' else ''} | {summary} | {peak:.0f} MiB |")


if __name__ == "__main__":
    main()
