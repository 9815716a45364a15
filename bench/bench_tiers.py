"""TTFT on SmolLM2 (CPU) through the two cache tiers: L1 hits with and without L2, and L2 hits on a
second host whose LMDB never saw the document.

Three daemons on loopback: P (LMDB only), A and B (each its own LMDB, both on one redis-server as
L2). An Engine in this process reads each daemon the way the service does by default (co-located
reads, Lookup and Store over gRPC). Every run: BASELINE; an L1 hit through P and through A (the same
warmed document, a new question); then a new document (same length, its own first line) is warmed
through A, A's write-behind queue drained to Redis, and asked through B: B's Lookup finds it in L2,
promotes it into B's LMDB, and the engine reads it from there. Runs are interleaved, medians reported.

    flock /tmp/kvboost-bench.lock python bench/bench_tiers.py            # 1600 tokens, 5 runs
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference_service import mkl_dispatch  # noqa: E402

MKL_DISPATCH = mkl_dispatch.apply()  # before torch: the service's default (KVBOOST_MKL_DISPATCH=vendor to compare)

import torch  # noqa: E402
from kvboost.v1 import cache_pb2  # noqa: E402

from bench import harness  # noqa: E402
from bench.bench_ttft import EnginePath, build_context, context_length, question  # noqa: E402
from inference_service.engine.engine import EngineConfig  # noqa: E402
from inference_service.model.loading import load_model  # noqa: E402
from inference_service.model.weights import DEFAULT_MODEL  # noqa: E402
from inference_service.store.colocated import ColocatedStore  # noqa: E402
from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions  # noqa: E402


def start_tier_daemons(stack: ExitStack, workdir: Path, redis_url: str) -> dict[str, str]:
    return {name: harness.start_daemon(stack, workdir, "--max-bytes", "8GB", *flags, name=f"lmdb-{name}").address
            for name, flags in (("P", ()), ("A", ("--l2", redis_url)), ("B", ("--l2", redis_url)))}


def engine_over(stack: ExitStack, name: str, loaded, config: EngineConfig, address: str,
                lookup_timeout_s: float) -> EnginePath:
    # A Lookup that hits L2 moves the blobs into LMDB before it answers: its deadline (the service's
    # --cache-timeout, 1 s by default) must cover that transfer, ~70 MB here in fp32.
    options = GrpcStoreOptions(address=address, rpc_timeout_s=lookup_timeout_s, fetch_timeout_s=60.0,
                               store_timeout_s=60.0)
    remote = GrpcChunkStore(options)
    stack.callback(remote.close)
    assert remote.check(), f"cache daemon at {address} does not answer"
    store = ColocatedStore(remote, "on")
    store.check()
    path = EnginePath(name, loaded, config, store)
    stack.callback(path.close)
    return path


def l2_stats(stub) -> cache_pb2.L2Stats:
    return stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10).l2


def drain_l2_writes(stub, timeout_s: float = 60.0) -> None:
    """Waits until the daemon's L2 write-behind queue (the batch being written included) is empty."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = l2_stats(stub)
        if stats.queued_writes == 0:
            return
        assert time.monotonic() < deadline and not stats.degraded, f"L2 writes did not drain: {stats}"
        time.sleep(0.01)


def measure(paths: dict[str, EnginePath], stub_a, context: str, runs: int) -> dict[str, list[dict]]:
    paths["L1 hit, no L2"].warm(context)
    paths["L1 hit, L2 on"].warm(context)
    asked, copies = iter(range(1 << 30)), iter(range(1 << 30))

    def l2_hit() -> dict:  # a document host B has never seen: warmed on A, reaching B through Redis only
        fresh = f"Handbook copy {next(copies)}.\n" + context
        paths["warm on A"].warm(fresh)
        paths["warm on A"].engine.flush_writes()  # A's Store replied: every chunk is in A's L2 queue
        drain_l2_writes(stub_a)
        return paths["L2 hit"].ask(fresh + question(next(asked)), "prefix_cache")

    return harness.alternate({
        "baseline": lambda: paths["L1 hit, no L2"].ask(context + question(next(asked)), "baseline"),
        **{name: lambda name=name: paths[name].ask(context + question(next(asked)), "prefix_cache")
           for name in ("L1 hit, no L2", "L1 hit, L2 on")},
        "L2 hit": l2_hit}, runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--length", type=int, default=1600, help="prompt tokens")
    parser.add_argument("--runs", type=int, default=5, help="requests per path (medians; at least 5)")
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--lookup-timeout", type=float, default=10.0,
                        help="seconds for a Lookup (the service's --cache-timeout, 1 s by default): an L2 hit's "
                             "Lookup promotes the blobs into LMDB before it answers")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    assert args.runs >= 5, "medians need at least 5 runs"
    from tests.daemon_support import cache_stub
    from tests.redis_support import redis_node

    loaded = load_model(args.model, device="cpu", dtype="float32")
    config = EngineConfig(chunk_size=args.chunk_size)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-tiers-")))
        redis = stack.enter_context(redis_node(workdir / "redis"))
        addresses = start_tier_daemons(stack, workdir, redis.url)
        paths = {name: engine_over(stack, name, loaded, config, addresses[daemon], args.lookup_timeout)
                 for name, daemon in (("L1 hit, no L2", "P"), ("L1 hit, L2 on", "A"), ("L2 hit", "B"))}
        paths["warm on A"] = paths["L1 hit, L2 on"]
        stub_a = stack.enter_context(cache_stub(addresses["A"]))
        context = build_context(loaded.tokenizer, context_length(args.length, args.chunk_size, aligned=False))
        samples = measure(paths, stub_a, context, args.runs)
        with cache_stub(addresses["B"]) as stub_b:
            b_stats = l2_stats(stub_b)
        a_stats = l2_stats(stub_a)
    medians = {name: harness.median(s["ttft_ms"] for s in rows) for name, rows in samples.items()}
    harness.print_table(f"bench_tiers: {loaded.model_id}, CPU fp32, {torch.get_num_threads()} threads, chunk_size "
                        f"{args.chunk_size}, ~{args.length}-token prompts, median of {args.runs} alternating runs, "
                        "redis-server on loopback",
                        [{"path": name, "prompt": rows[-1]["prompt"], "cached": rows[-1]["cached"],
                          "ttft_ms": medians[name], "x": f"{medians['baseline'] / medians[name]:.1f}x"}
                         for name, rows in samples.items()],
                        ["path", "prompt", "cached", ("ttft_ms", "TTFT ms"), ("x", "x BASELINE")], digits=1)
    reuse = [s["cached"] / s["prompt"] for s in samples["L2 hit"]]
    l1_change = medians["L1 hit, L2 on"] / medians["L1 hit, no L2"] - 1
    print(f"\nL2 hit vs BASELINE: {medians['baseline'] / medians['L2 hit']:.1f}x (target >= 5x)")
    print(f"L1 hit with L2 configured vs without: {l1_change:+.1%} (target within 5%)")
    print(f"cross-host reuse on B: min {min(reuse):.1%} of the prompt (target >= 90%)")
    print(f"L2 counters: A writes {a_stats.writes}, dropped {a_stats.dropped_writes}, errors {a_stats.errors}; "
          f"B hits {b_stats.hits}, misses {b_stats.misses}, corrupted {b_stats.corrupted}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    harness.write_json(args.out / f"tiers-{stamp}.json", {"medians_ms": medians, "samples": samples})
    print(f"wrote {args.out}/tiers-{stamp}.json")


if __name__ == "__main__":
    main()
