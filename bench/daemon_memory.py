"""Does the cache daemon's heap (RssAnon) plateau or grow under a long Fetch-heavy load?

Starts a real daemon process (`python -m cache_daemon`) on a fresh LMDB environment, Stores a few
large pinned chunks once (a cached system prompt's K/V), then runs `--calls` iterations from
`--threads` client threads, each iteration what one inference request does: Lookup the large
chunks, Fetch them all over the gRPC stream, Store one new small chunk under a new key. After
every `--round` iterations it prints the daemon's RssAnon (its own heap: where a leak shows) and
RssFile (LMDB pages the kernel maps in for it: bounded by the file and the kernel's to drop), read
while the clients pause so no call is in flight (what is resident then is retained), and
at the end a verdict: the least-squares slope of RssAnon over the second half of the rounds, in
MiB per 1000 calls, "plateau" when it is below --plateau-mib.

    flock /tmp/kvboost-bench.lock python bench/daemon_memory.py
    flock /tmp/kvboost-bench.lock python bench/daemon_memory.py --daemon-env MALLOC_ARENA_MAX=2
    flock /tmp/kvboost-bench.lock python bench/daemon_memory.py --calls 200 --round 50   # a quick look

Loopback only; the daemon and its data directory are removed at the end.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

import grpc  # noqa: E402
from kvboost.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402

from cache_daemon.config import parse_size  # noqa: E402
from tests.conftest import pick_free_port  # noqa: E402
from tests.e2e.daemon_process import start_daemon  # noqa: E402

NAMESPACE = hashlib.sha256(b"daemon memory probe").digest()
FRAME_BYTES = 1 << 20
MIB = 1 << 20


def chunk_key(label: str, number: int) -> bytes:
    return hashlib.sha256(f"{label}:{number}".encode()).digest()


def store_frames(key: bytes, blob: bytes, pinned: bool = False):
    meta = cache_pb2.ChunkMeta(key=key, namespace=NAMESPACE, size_bytes=len(blob), checksum=zlib.crc32(blob),
                               num_tokens=128, pinned=pinned)
    yield cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=meta))
    for start in range(0, len(blob), FRAME_BYTES):
        yield cache_pb2.ChunkFrame(data=blob[start:start + FRAME_BYTES])


def rss_kib(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of the process, in KiB, from /proc/PID/status."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile"):
            fields[name] = int(value.split()[0])
    return fields


def linear_fit(calls: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares slope of values over calls, per 1000 calls, and the residuals' standard deviation."""
    mean_x, mean_y = sum(calls) / len(calls), sum(values) / len(values)
    spread = sum((x - mean_x) ** 2 for x in calls)
    slope = 0.0 if spread == 0 else sum((x - mean_x) * (y - mean_y) for x, y in zip(calls, values)) / spread
    residuals = [y - mean_y - slope * (x - mean_x) for x, y in zip(calls, values)]
    return 1000 * slope, (sum(r * r for r in residuals) / len(residuals)) ** 0.5


@dataclass
class Progress:
    """Iterations handed out and finished, shared by the client threads."""

    total: int
    limit: int = 0  # iterations handed out up to here; the main thread raises it round by round
    next_number: int = 0
    num_done: int = 0
    num_bytes_fetched: int = 0
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.round_done = threading.Condition(self.lock)

    def take(self) -> int | None:
        """The next iteration's number, once the round allows it; None when all are handed out."""
        with self.lock:
            self.round_done.wait_for(lambda: self.next_number < self.limit or self.next_number >= self.total
                                     or self.error is not None)
            if self.next_number >= self.total or self.error is not None:
                return None
            self.next_number += 1
            return self.next_number - 1

    def open_round(self, limit: int) -> None:
        with self.lock:
            self.limit = limit
            self.round_done.notify_all()

    def finish(self, num_bytes: int) -> None:
        with self.lock:
            self.num_done += 1
            self.num_bytes_fetched += num_bytes
            self.round_done.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.error = error
            self.round_done.notify_all()


def one_request(stub, hot_keys: list[bytes], number: int, store_blob: bytes) -> int:
    """Lookup + Fetch of every hot chunk + Store of one new chunk; returns the bytes fetched."""
    reply = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=hot_keys))
    assert reply.prefix_run == len(hot_keys), f"hot chunks missing: prefix_run={reply.prefix_run}"
    num_bytes = 0
    for frame in stub.Fetch(cache_pb2.FetchRequest(keys=hot_keys)):
        if frame.WhichOneof("frame") == "data":
            num_bytes += len(frame.data)
        else:
            assert frame.header.found, f"hot chunk {frame.header.meta.key.hex()[:16]} not found"
    # A new key per request, with new bytes (the blob's first 8 bytes are the request number).
    blob = number.to_bytes(8, "little") + store_blob[8:]
    stub.Store(store_frames(chunk_key("new", number), blob))
    return num_bytes


def client_loop(stub, hot_keys: list[bytes], store_blob: bytes, progress: Progress) -> None:
    try:
        while (number := progress.take()) is not None:
            progress.finish(one_request(stub, hot_keys, number, store_blob))
    except BaseException as error:  # reported by the main thread
        progress.fail(error)


def wait_for(progress: Progress, num_done: int) -> None:
    with progress.lock:
        progress.round_done.wait_for(lambda: progress.num_done >= num_done or progress.error is not None)
        if progress.error is not None:
            raise RuntimeError(f"a client failed: {progress.error!r}") from progress.error


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, separator, value = item.partition("=")
        if not separator or not name:
            raise argparse.ArgumentTypeError(f"--daemon-env takes NAME=VALUE, got {item!r}")
        env[name] = value
    return env


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=6,
                        help="large chunks stored once (pinned) and Fetched by every call (default 6)")
    parser.add_argument("--chunk-bytes", type=parse_size, default=parse_size("5600K"),
                        help="bytes of each large chunk (default 5600K: one 128-token SmolLM2 fp32 chunk)")
    parser.add_argument("--store-bytes", type=parse_size, default=parse_size("100K"),
                        help="bytes of the new chunk each call Stores (default 100K)")
    parser.add_argument("--threads", type=int, default=16, help="client threads calling at once (default 16)")
    parser.add_argument("--calls", type=int, default=3000, help="iterations in all (default 3000)")
    parser.add_argument("--round", type=int, default=250,
                        help="iterations between two RSS readings; one output line each (default 250)")
    parser.add_argument("--settle", type=float, default=0.5,
                        help="seconds the clients pause at the end of each round before RSS is read, so no call "
                             "is in flight (default 0.5)")
    parser.add_argument("--max-bytes", type=parse_size, default=parse_size("256M"),
                        help="the daemon's --max-bytes; small enough that the Stores evict (default 256M)")
    parser.add_argument("--daemon-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment variable for the daemon process, e.g. MALLOC_ARENA_MAX=2 (repeatable)")
    parser.add_argument("--malloc-report", action="store_true",
                        help="at the end, attach gdb to the daemon and call glibc's malloc_stats() (bytes its arenas "
                             "hold from the system vs bytes in use: the gap is freed memory the allocator keeps) "
                             "and then malloc_trim(0), and print RssAnon after the trim (needs gdb and ptrace)")
    parser.add_argument("--plateau-mib", type=float, default=1.0,
                        help="verdict 'plateau' when RssAnon grows less than this many MiB per 1000 calls over "
                             "the second half of the rounds (default 1.0)")
    args = parser.parse_args(argv)
    if min(args.chunks, args.threads, args.calls, args.round) < 1:
        parser.error("--chunks, --threads, --calls and --round must be positive")
    args.daemon_env = parse_env(args.daemon_env)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    hot_keys = [chunk_key("hot", number) for number in range(args.chunks)]
    rng = random.Random(0)
    store_blob = rng.randbytes(args.store_bytes)
    with tempfile.TemporaryDirectory(prefix="kvboost-memory-") as work_dir:
        daemon = start_daemon(Path(work_dir) / "lmdb", pick_free_port(), "--max-bytes", str(args.max_bytes),
                              "--log-level", "WARNING", env=args.daemon_env)
        pid = daemon.process.pid
        try:
            with grpc.insecure_channel(daemon.address) as channel:
                stub = cache_pb2_grpc.CacheServiceStub(channel)
                for key in hot_keys:
                    stub.Store(store_frames(key, rng.randbytes(args.chunk_bytes), pinned=True))
                start = rss_kib(pid)
                env_text = " ".join(f"{name}={value}" for name, value in args.daemon_env.items()) or "(none)"
                print(f"daemon pid {pid}, env {env_text}; {args.chunks} x {args.chunk_bytes / MIB:.1f} MiB pinned "
                      f"chunks Fetched per call, {args.store_bytes / 1024:.0f} KiB Stored per call, "
                      f"{args.threads} threads, {os.cpu_count()} CPUs", flush=True)
                print(f"{'calls':>6} {'RssAnon MiB':>12} {'RssFile MiB':>12} {'GB fetched':>11} {'s':>7}", flush=True)
                print(f"{0:>6} {start['RssAnon'] / 1024:>12.1f} {start['RssFile'] / 1024:>12.1f} {0:>11.2f} "
                      f"{0:>7.1f}", flush=True)
                calls, anon = run_rounds(args, stub, hot_keys, store_blob, pid)
                if args.malloc_report:
                    print_malloc_report(daemon, pid)
        finally:
            daemon.terminate()
    print_verdict(args, calls, anon, start["RssAnon"] / 1024)


def run_rounds(args, stub, hot_keys, store_blob, pid) -> tuple[list[int], list[float]]:
    progress = Progress(args.calls)
    threads = [threading.Thread(target=client_loop, args=(stub, hot_keys, store_blob, progress), daemon=True)
               for _ in range(args.threads)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    calls: list[int] = []
    anon: list[float] = []
    for target in range(args.round, args.calls + args.round, args.round):
        progress.open_round(min(target, args.calls))
        wait_for(progress, min(target, args.calls))
        time.sleep(args.settle)  # no call in flight: what stays is retained, not buffers of live streams
        sample = rss_kib(pid)
        calls.append(progress.num_done)
        anon.append(sample["RssAnon"] / 1024)
        print(f"{progress.num_done:>6} {anon[-1]:>12.1f} {sample['RssFile'] / 1024:>12.1f} "
              f"{progress.num_bytes_fetched / 1e9:>11.2f} {time.perf_counter() - started:>7.1f}", flush=True)
    for thread in threads:
        thread.join()
    return calls, anon


def gdb_call(pid: int, expression: str) -> None:
    """Runs `call expression` inside the process through gdb (the process is stopped meanwhile)."""
    subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", f"call {expression}"], check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def print_malloc_report(daemon, pid: int) -> None:
    """glibc's own account of the daemon's heap (written to the daemon's stderr, so its log), then a trim."""
    if shutil.which("gdb") is None:
        print("malloc report: gdb is not installed")
        return
    log_start = len(daemon.log())
    gdb_call(pid, "(void) malloc_stats()")
    time.sleep(0.5)
    report = daemon.log()[log_start:]
    arenas = re.findall(r"Arena \d+:\nsystem bytes\s+=\s+(\d+)\nin use bytes\s+=\s+(\d+)", report)
    total = re.search(r"Total \(incl. mmap\):\nsystem bytes\s+=\s+(\d+)\nin use bytes\s+=\s+(\d+)", report)
    if total is None:
        print("malloc report: no malloc_stats() output in the daemon's log")
        return
    system, in_use = (int(value) / MIB for value in total.groups())
    print(f"malloc_stats: {len(arenas)} arenas; system {system:.1f} MiB, in use {in_use:.1f} MiB, "
          f"free but kept {system - in_use:.1f} MiB; per arena (system/in use MiB): "
          + " ".join(f"{int(a) / MIB:.0f}/{int(b) / MIB:.0f}" for a, b in arenas))
    before = rss_kib(pid)["RssAnon"] / 1024
    gdb_call(pid, "(int) malloc_trim(0)")
    after = rss_kib(pid)["RssAnon"] / 1024
    print(f"malloc_trim(0): RssAnon {before:.1f} -> {after:.1f} MiB")


def print_verdict(args, calls: list[int], anon: list[float], start_anon: float) -> None:
    """Growth: the second half's slope is at least --plateau-mib per 1000 calls and its rise over that
    half stands out of the noise (twice the residuals' deviation); a plateau otherwise."""
    half = len(calls) // 2
    tail_calls, tail_anon = calls[half:], anon[half:]
    if len(tail_calls) < 3:
        print(f"verdict: none: RssAnon {start_anon:.1f} -> max {max(anon):.1f} -> last {anon[-1]:.1f} MiB; too few "
              "rounds to tell growth from noise (give --calls at least 6 x --round)")
        return
    slope, noise = linear_fit(tail_calls, tail_anon)
    rise = slope * (tail_calls[-1] - tail_calls[0]) / 1000
    verdict = "growth" if slope >= args.plateau_mib and rise > 2 * noise else "plateau"
    print(f"verdict: {verdict}: RssAnon {start_anon:.1f} -> max {max(anon):.1f} -> last {anon[-1]:.1f} MiB; "
          f"over calls {tail_calls[0]}..{tail_calls[-1]} mean {sum(tail_anon) / len(tail_anon):.1f} MiB, slope "
          f"{slope:+.2f} MiB per 1000 calls, noise +-{noise:.1f} MiB (growth: slope >= {args.plateau_mib} "
          f"and a rise above twice the noise)")


if __name__ == "__main__":
    main()
