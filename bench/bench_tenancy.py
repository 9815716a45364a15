"""Tenancy at the daemon: can tenant B time whether tenant A holds a chunk, and what does the check cost A's TTFT?

1. Miss vs cross-tenant key: B's Lookup and Fetch of the keys A holds against keys nobody holds, alternated in
   random order (many samples); medians, p99 and the difference of medians with a bootstrap 95% interval. A
   control row (B's own held keys vs keys nobody holds) shows the method sees a difference where one exists.
2. TTFT at ~1600 tokens (SmolLM2, CPU fp32, exact prefix reuse): the engine over a daemon without a tenants
   file against the same engine over a daemon with one (presenting a tenant token), both over the gRPC Fetch
   stream, alternated per run; medians and their ratio (target < 1% extra). A third row, the plain daemon with
   co-located reads, shows what a tenant gives up: Describe is admin-only, so tenants read over the stream.
Loopback only: it starts its own daemons on free 127.0.0.1 ports and stops them at the end.

    python bench/bench_tenancy.py            # 4000 timing samples per row, 40 TTFT runs (~4 minutes)
    python bench/bench_tenancy.py --quick    # 1000 samples, 12 TTFT runs (~1 minute)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

import grpc  # noqa: E402
from kvboost.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402

TOKENS = {"alice": "bench-alice-token-5b1e", "bob": "bench-bob-token-9c4d", "ops": "bench-ops-token-2a7f"}
KEYS_PER_REQUEST = 12  # a 1600-token prompt in 128-token chunks
CHUNK_BYTES = 64 * 1024


def write_tenants_file(folder: Path) -> Path:
    path = folder / "tenants.json"
    path.write_text(json.dumps({"tenants": {"alice": {"token": TOKENS["alice"]}, "bob": {"token": TOKENS["bob"]},
                                            "ops": {"token": TOKENS["ops"], "admin": True}}}))
    return path


def as_tenant(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[name]}")]


def start_daemons(stack: ExitStack, work_dir: Path) -> tuple[str, str]:
    """(plain daemon, daemon with a tenants file), each with its own LMDB; stopped when `stack` closes."""
    from tests.conftest import pick_free_port
    from tests.e2e.daemon_process import start_daemon

    plain = start_daemon(work_dir / "lmdb-plain", pick_free_port(), "--max-bytes", "4GB")
    stack.callback(plain.terminate)
    tenants = start_daemon(work_dir / "lmdb-tenants", pick_free_port(), "--max-bytes", "4GB",
                           "--tenants-file", str(write_tenants_file(work_dir)))
    stack.callback(tenants.terminate)
    return plain.address, tenants.address


# ---- 1. miss vs cross-tenant key ----

def random_digests(rng: random.Random, count: int) -> list[bytes]:
    return [rng.randbytes(32) for _ in range(count)]


def store_chunks(stub, metadata, namespace: bytes, keys: list[bytes], rng: random.Random) -> None:
    from kvboost_common.checksum import crc32

    frames = []
    for key in keys:
        blob = rng.randbytes(CHUNK_BYTES)
        meta = cache_pb2.ChunkMeta(key=key, namespace=namespace, num_tokens=128, size_bytes=len(blob),
                                   checksum=crc32(blob))
        frames += [cache_pb2.ChunkFrame(header=cache_pb2.ChunkHeader(meta=meta)), cache_pb2.ChunkFrame(data=blob)]
    reply = stub.Store(iter(frames), metadata=metadata, timeout=60)
    assert reply.stored == len(keys), f"stored {reply.stored} of {len(keys)}"


def timed_call(call, request, metadata) -> tuple[float, object]:
    started = time.perf_counter()
    reply = call(request, metadata=metadata, timeout=10)
    if not hasattr(reply, "SerializeToString"):  # a stream: drain it
        reply = list(reply)
    return (time.perf_counter() - started) * 1e6, reply


def probe_rows(stub, samples: int, rng: random.Random) -> list[dict]:
    """Alice stores held_sets of 12 chunks, bob stores his own; bob then probes, in random order per pair."""
    namespace = rng.randbytes(32)
    num_sets = 16
    alice_sets = [random_digests(rng, KEYS_PER_REQUEST) for _ in range(num_sets)]
    bob_sets = [random_digests(rng, KEYS_PER_REQUEST) for _ in range(num_sets)]
    for keys in alice_sets:
        store_chunks(stub, as_tenant("alice"), namespace, keys, rng)
    for keys in bob_sets:
        store_chunks(stub, as_tenant("bob"), namespace, keys, rng)
    bob = as_tenant("bob")

    def lookup(keys):
        return stub.Lookup, cache_pb2.LookupRequest(namespace=namespace, prefix_keys=keys)

    def fetch(keys):
        return stub.Fetch, cache_pb2.FetchRequest(keys=keys)

    comparisons = [("Lookup", "alice's keys", alice_sets, lookup), ("Fetch", "alice's keys", alice_sets, fetch),
                   ("Lookup", "bob's own (control)", bob_sets, lookup),
                   ("Fetch", "bob's own (control)", bob_sets, fetch)]
    rows = []
    for rpc, label, held_sets, build in comparisons:
        for _ in range(50):  # warm-up
            timed_call(*build(random_digests(rng, KEYS_PER_REQUEST)), bob)
        held_us, never_us = [], []
        for index in range(samples):
            pair = [("held", build(held_sets[index % num_sets])),
                    ("never", build(random_digests(rng, KEYS_PER_REQUEST)))]
            rng.shuffle(pair)
            for kind, (call, request) in pair:
                elapsed, reply = timed_call(call, request, bob)
                found = (reply.prefix_run > 0) if rpc == "Lookup" else any(
                    frame.HasField("header") and frame.header.found for frame in reply)
                if kind == "never" or label.startswith("alice"):
                    assert not found, f"bob's {rpc} of {label if kind == 'held' else 'unknown keys'} found something"
                (held_us if kind == "held" else never_us).append(elapsed)
        rows.append(compare(rpc, label, held_us, never_us, rng))
    return rows


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def compare(rpc: str, label: str, held: list[float], never: list[float], rng: random.Random) -> dict:
    """Medians, p99 and a bootstrap 95% interval of median(held) - median(never)."""
    differences = []
    for _ in range(1000):
        differences.append(statistics.median(rng.choices(held, k=len(held)))
                           - statistics.median(rng.choices(never, k=len(never))))
    return {"rpc": rpc, "keys": label, "samples": len(held), "median_us": statistics.median(held),
            "never_median_us": statistics.median(never), "p99_us": percentile(held, 0.99),
            "never_p99_us": percentile(never, 0.99),
            "difference_us": statistics.median(held) - statistics.median(never),
            "ci_low_us": percentile(differences, 0.025), "ci_high_us": percentile(differences, 0.975)}


def print_probe_rows(rows: list[dict]) -> None:
    print(f"\nbob probing: keys held vs keys nobody holds, {KEYS_PER_REQUEST} keys per request, "
          f"{rows[0]['samples']} alternated pairs per row (microseconds)\n")
    header = (f"{'rpc':<7} {'held keys':<20} {'median':>8} {'p99':>8} {'never median':>12} {'never p99':>9} "
              f"{'diff':>7} {'95% CI of diff':>18}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['rpc']:<7} {r['keys']:<20} {r['median_us']:>8.1f} {r['p99_us']:>8.1f} {r['never_median_us']:>12.1f} "
              f"{r['never_p99_us']:>9.1f} {r['difference_us']:>7.1f} "
              f"{'[' + format(r['ci_low_us'], '.1f') + ', ' + format(r['ci_high_us'], '.1f') + ']':>18}", flush=True)


# ---- 2. TTFT with and without the tenants check ----

def check_cost_us() -> float:
    """CPU time of what tenancy adds to one ~1600-token request: the key mapping of a Lookup (namespace +
    12 keys), of a Fetch (12 keys in, 12 namespaces out), of the write-back Store, and two token digests."""
    import timeit

    from cache_daemon.tenancy import KeySpace
    from kvboost_common.auth import _token_digest

    space, keys = KeySpace(os.urandom(32)), [os.urandom(32) for _ in range(KEYS_PER_REQUEST)]

    def per_request() -> None:
        space.scope(keys[0])
        space.scope_all(keys)
        space.scope_all(keys)
        [space.unscope(key) for key in keys]
        _token_digest(TOKENS["alice"])
        _token_digest(TOKENS["alice"])

    return min(timeit.repeat(per_request, number=2000, repeat=5)) / 2000 * 1e6


def ratio_interval(candidate: list[float], baseline: list[float], rng: random.Random) -> tuple[float, float]:
    """Bootstrap 95% interval of median(candidate) / median(baseline)."""
    ratios = sorted(statistics.median(rng.choices(candidate, k=len(candidate)))
                    / statistics.median(rng.choices(baseline, k=len(baseline))) for _ in range(2000))
    return ratios[50], ratios[1949]

def ttft_rows(plain_address: str, tenants_address: str, runs: int, prompt_tokens: int, stack: ExitStack) -> list[dict]:
    import torch

    from bench.bench_ttft import build_context, context_length, question
    from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
    from inference_service.model.loading import load_model
    from inference_service.model.weights import DEFAULT_MODEL
    from inference_service.store.colocated import ColocatedStore
    from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions

    def store(address: str, token: str | None) -> GrpcChunkStore:
        chunk_store = GrpcChunkStore(GrpcStoreOptions(address=address, auth_token=token, fetch_timeout_s=60.0,
                                                      store_timeout_s=60.0))
        stack.callback(chunk_store.close)
        assert chunk_store.check(), f"cache daemon at {address} does not answer"
        return chunk_store

    loaded = load_model(DEFAULT_MODEL, device="cpu", dtype="float32")
    config = EngineConfig(chunk_size=128)
    colocated = ColocatedStore(store(plain_address, None), "on")
    colocated.check()
    stores = {"no tenants, stream": store(plain_address, None),
              "tenant token, stream": store(tenants_address, TOKENS["alice"]),
              "no tenants, co-located": colocated}
    engines = {name: Engine(loaded.model, loaded.tokenizer, config, chunk_store, model_id=loaded.model_id)
               for name, chunk_store in stores.items()}
    context = build_context(loaded.tokenizer, context_length(prompt_tokens, 128, aligned=True))
    for engine in engines.values():
        engine.generate(GenerationParams(prompt="Warm-up.", max_new_tokens=1, mode="baseline"))
        engine.warm(context)
        engine.flush_writes()
    samples: dict[str, list[float]] = {name: [] for name in engines}
    asked = 0
    names = list(engines)
    for run in range(runs + 2):  # the first two runs warm caches and allocators, then are dropped
        for name in names[run % len(names):] + names[:run % len(names)]:  # each path leads in turn
            asked += 1
            outcome = engines[name].generate(GenerationParams(prompt=context + question(asked), max_new_tokens=1,
                                                              mode="prefix_cache"))
            engines[name].flush_writes()
            assert not outcome.degraded and outcome.cached_tokens > 0, f"{name}: no reuse"
            if run >= 2:
                samples[name].append(outcome.ttft_ms)
    for engine in engines.values():
        engine.close()
    baseline = statistics.median(samples["no tenants, stream"])
    check_us = check_cost_us()
    print(f"\nTTFT, {loaded.model_id}, CPU fp32, {torch.get_num_threads()} threads, ~{prompt_tokens}-token prompt "
          f"({outcome.cached_tokens} cached), median of {runs} alternated runs\n")
    rows = []
    for name, values in samples.items():
        median = statistics.median(values)
        low, high = ratio_interval(values, samples["no tenants, stream"], random.Random(7))
        rows.append({"path": name, "median_ms": median, "ratio": median / baseline, "ratio_ci": [low, high],
                     "ttft_ms": values})
        print(f"{name:<24} median {median:7.1f} ms   x no-tenants stream {median / baseline:.3f} "
              f"(95% CI {low:.3f}-{high:.3f})", flush=True)
    print(f"tenancy's own CPU work per request (key mapping, token digests): {check_us:.0f} us = "
          f"{check_us / 1000 / baseline:.3%} of the no-tenants median", flush=True)
    rows.append({"path": "check cost", "check_us": check_us, "fraction_of_ttft": check_us / 1000 / baseline})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, help="alternated pairs per timing row (default 4000, --quick 1000)")
    parser.add_argument("--runs", type=int, help="TTFT runs per path (default 40, --quick 12)")
    parser.add_argument("--prompt-tokens", type=int, default=1600)
    parser.add_argument("--quick", action="store_true", help="fewer samples and runs (about a minute)")
    parser.add_argument("--no-ttft", action="store_true", help="the timing rows only (no model)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the JSON goes")
    args = parser.parse_args(argv)
    samples = args.samples or (1000 if args.quick else 4000)
    runs = args.runs or (12 if args.quick else 40)
    assert runs >= 5, "medians need at least 5 runs"
    rng = random.Random(20)
    results: dict = {"started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-tenancy-")))
        plain_address, tenants_address = start_daemons(stack, work_dir)
        with grpc.insecure_channel(tenants_address) as channel:
            results["probes"] = probe_rows(cache_pb2_grpc.CacheServiceStub(channel), samples, rng)
        print_probe_rows(results["probes"])
        if not args.no_ttft:
            results["ttft"] = ttft_rows(plain_address, tenants_address, runs, args.prompt_tokens, stack)
    args.out.mkdir(parents=True, exist_ok=True)
    results["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    path = args.out / f"tenancy-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"\nstarted {results['started_utc']} UTC, finished {results['finished_utc']} UTC; wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
