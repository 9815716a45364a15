"""A cross-host Lookup of L2-only keys on a busy machine: the daemon's value-free Lookup next to reading the values.

Each round plants --keys fresh signed records of --value-kib in the daemon's Redis L2 only, then times the daemon's
Lookup of them (it checks L2 by size; the values follow into LMDB behind it) and an MGET of the same records (the least
a Lookup moving the values had to do), alternating which goes first, while --load processes rewrite 256 MB buffers.
Every Lookup must answer all its keys; a round that does not stops the run.

    python bench/bench_l2_lookup.py                   # 25 rounds of 64 keys x 256 KiB under load
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from contextlib import ExitStack, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis as redis_py  # noqa: E402
from kvboost.v1 import cache_pb2  # noqa: E402

from bench import harness  # noqa: E402
from cache_daemon.entry import ChunkKey, IncomingChunk  # noqa: E402
from cache_daemon.l2.record_auth import load_keyring  # noqa: E402
from cache_daemon.l2.redis_tier import CHUNK_PREFIX, encode_record  # noqa: E402
from tests.daemon_support import NAMESPACE, cache_stub, digest, shared_l2_key_file  # noqa: E402
from tests.e2e.memory_load import memory_heavy_load  # noqa: E402
from tests.redis_support import redis_node  # noqa: E402


def measure(folder: Path, rounds: int, num_keys: int, value_bytes: int, load: int) -> dict[str, list[float]]:
    """Seconds per round for 'lookup' (the daemon's) and 'mget' (reading the same values), alternating."""
    keyring = load_keyring(shared_l2_key_file(folder))
    blob = os.urandom(value_bytes)
    timings: dict[str, list[float]] = {"lookup": [], "mget": []}
    with redis_node(folder / "redis") as node, ExitStack() as stack:
        daemon = harness.start_daemon(stack, folder, "--l2", node.url)
        client = stack.enter_context(redis_py.Redis(host="127.0.0.1", port=node.port))
        stub = stack.enter_context(cache_stub(daemon.address))
        stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[digest("warm-up")]), timeout=10)
        client.mget([b"warm-up"])

        def lookup(keys: list[bytes], names: list[bytes]) -> None:
            reply = stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=keys), timeout=10)
            if reply.prefix_run != len(keys):
                raise SystemExit(f"a Lookup of {len(keys)} L2-only keys answered {reply.prefix_run}")

        def mget(keys: list[bytes], names: list[bytes]) -> None:
            values = client.mget(names)
            if any(value is None or len(value) < value_bytes for value in values):
                raise SystemExit("an MGET missed a record it had just planted")

        with memory_heavy_load(num_processes=load) if load else nullcontext():
            for round_index in range(rounds):
                keys = [digest(f"round {round_index} key {index}") for index in range(num_keys)]
                records = {CHUNK_PREFIX + key: encode_record(IncomingChunk(
                    key=ChunkKey(key), namespace=NAMESPACE, content_key=b"", num_tokens=16,
                    checksum=zlib.crc32(blob), pinned=False, blob=blob), keyring) for key in keys}
                client.mset(records)
                for name in harness.in_turn(("lookup", "mget"), round_index):
                    started = time.perf_counter()
                    {"lookup": lookup, "mget": mget}[name](keys, list(records))
                    timings[name].append(time.perf_counter() - started)
                client.delete(*records)  # Redis stays small; a promotion not yet done finds them gone (misses)
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=25, help="rounds, each with fresh keys (default 25)")
    parser.add_argument("--keys", type=int, default=64, help="L2-only keys per Lookup (default 64)")
    parser.add_argument("--value-kib", type=int, default=256, help="bytes behind each key, in KiB (default 256)")
    parser.add_argument("--load", type=int, default=2, help="processes rewriting 256 MB buffers beside the run "
                        "(default 2; 0 = an idle machine)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.keys < 1 or args.value_kib < 1 or args.load < 0:
        parser.error("--rounds, --keys and --value-kib must be >= 1 and --load >= 0")
    with tempfile.TemporaryDirectory(prefix="bench-l2-lookup-") as folder:
        timings = measure(Path(folder), args.rounds, args.keys, args.value_kib << 10, args.load)
    behind = args.keys * args.value_kib / 1024
    labels = {"lookup": "Lookup (value-free check, values follow)", "mget": "MGET of the values (a Lookup moving them)"}
    harness.print_table(f"bench_l2_lookup: L2-only keys: {args.keys} x {args.value_kib} KiB ({behind:.1f} MiB behind "
                        f"each Lookup), {args.rounds} rounds, {args.load} load processes",
                        [{"path": label, "p50": harness.median(timings[name]) * 1000,
                          "p99": harness.percentile(timings[name], 0.99) * 1000, "max": max(timings[name]) * 1000}
                         for name, label in labels.items()], ["path", ("p50", "p50 ms"), ("p99", "p99 ms"),
                                                              ("max", "max ms")], digits=1)
    p99 = harness.percentile(timings["lookup"], 0.99) * 1000
    print(f"Lookup p99 {p99:.1f} ms against the target of 50 ms: {'met' if p99 <= 50 else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
