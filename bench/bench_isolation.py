"""Tenant isolation shown by timing: two services with different --tenant-salt on one daemon, same prompt.

A ~1000-token context is warmed through tenant A. Each run then asks a new question after it, interleaved:
tenant A in PREFIX_CACHE (hits its own chunks), tenant B in PREFIX_CACHE (same prompt: must hit nothing) and
tenant B in BASELINE. B-cached / B-baseline near 1 shows B got nothing from A's chunks; A is many times
faster. B's own write-back of the context is deleted (Delete of B's namespace) after each B cached run, so
every B run starts as cold as the first. TTFT is the service's own (request arrival to first token).
Loopback only: it starts its own daemon and services on free 127.0.0.1 ports and stops them at the end.

    python bench/bench_isolation.py                 # SmolLM2, 1024-token context, 5 runs, 1 thread per service
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from kvboost.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402
from kvboost.v1 import inference_pb2 as pb  # noqa: E402
from kvboost.v1 import inference_pb2_grpc  # noqa: E402

TENANTS = ("alpha", "beta")  # tenant A and tenant B
# (label, tenant index, mode), interleaved within each run so drift hits every measurement alike.
MEASUREMENTS = (("A PREFIX_CACHE", 0, pb.PREFIX_CACHE), ("B PREFIX_CACHE", 1, pb.PREFIX_CACHE),
                ("B BASELINE", 1, pb.BASELINE))


def namespace_entries(cache_stub: cache_pb2_grpc.CacheServiceStub) -> dict[bytes, int]:
    stats = cache_stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10)
    return {entry.namespace: entry.entries for entry in stats.namespaces}


def wait_for_entries(cache_stub: cache_pb2_grpc.CacheServiceStub, namespace: bytes, entries: int,
                     timeout_s: float = 60.0) -> None:
    """Write-back runs in the background: poll Stats until the namespace holds `entries` chunks."""
    deadline = time.monotonic() + timeout_s
    while namespace_entries(cache_stub).get(namespace, 0) < entries:
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {namespace.hex()[:16]} never reached {entries} entries")
        time.sleep(0.05)


def generate(stub: inference_pb2_grpc.InferenceServiceStub, prompt: str, mode: int) -> pb.GenerationResult:
    events = list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=1, mode=mode), timeout=300))
    result = events[-1].result
    assert not result.degraded, "the cache daemon was unreachable during the benchmark"
    return result


def start_stack(stack: ExitStack, model: str, chunk_size: int, work_dir: Path) -> tuple[str, list[str]]:
    """One daemon and one service per tenant on free loopback ports; stopped when `stack` closes."""
    from tests.conftest import pick_free_port
    from tests.e2e.daemon_process import start_daemon
    from tests.e2e.service_process import start_service

    daemon = start_daemon(work_dir / "lmdb", pick_free_port(), "--max-bytes", "2GB")
    stack.callback(lambda: daemon.process.poll() is None and daemon.terminate())
    addresses = []
    for salt in TENANTS:
        service = start_service(model, daemon.address, pick_free_port(), work_dir / f"service-{salt}.log",
                                "--chunk-size", str(chunk_size), "--tenant-salt", salt, timeout_s=300)
        stack.callback(lambda service=service: service.process.poll() is None and service.terminate())
        addresses.append(service.address)
    return daemon.address, addresses


def build_prompts(model: str, context_tokens: int, chunk_size: int, runs: int) -> tuple[str, list[str]]:
    """The shared context (a whole number of chunks) and one prompt per measurement, each with a new question."""
    from transformers import AutoTokenizer

    from bench.bench_ttft import build_context, context_length, question
    from inference_service.model.weights import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    context = build_context(tokenizer, context_length(context_tokens, chunk_size, aligned=True))
    return context, [context + question(number) for number in range(runs * len(MEASUREMENTS))]


def measure(stubs: list, cache_stub, context: str, prompts: list[str], runs: int) -> dict[str, list[pb.GenerationResult]]:
    namespaces = [bytes.fromhex(stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).namespace_hex) for stub in stubs]
    assert namespaces[0] != namespaces[1], "the tenant salt must change the namespace"
    warmed = stubs[0].Warm(pb.WarmRequest(text=context), timeout=300)
    wait_for_entries(cache_stub, namespaces[0], warmed.chunks_stored)
    entries = namespace_entries(cache_stub)
    print(f"warmed through tenant A: {warmed.token_count} tokens, {warmed.chunks_stored} chunks; daemon namespaces: "
          f"A {entries.get(namespaces[0], 0)} entries, B {entries.get(namespaces[1], 0)} entries", flush=True)
    for stub in stubs:  # first-call allocations stay out of the medians
        generate(stub, "Warm-up.", pb.BASELINE)
    results: dict[str, list[pb.GenerationResult]] = {label: [] for label, _, _ in MEASUREMENTS}
    prompt_iter = iter(prompts)
    for _ in range(runs):
        for label, tenant, mode in MEASUREMENTS:
            results[label].append(generate(stubs[tenant], next(prompt_iter), mode))
            if tenant == 1 and mode == pb.PREFIX_CACHE:
                # B wrote the context back under its own namespace: drop it so the next B run is cold again.
                wait_for_entries(cache_stub, namespaces[1], warmed.chunks_stored)
                cache_stub.Delete(cache_pb2.DeleteRequest(namespace=namespaces[1]), timeout=30)
    return results


NOISE_BAND = (0.8, 1.25)  # run-to-run TTFT noise on a shared CPU


def describe_b_ratio(ratio: float) -> str:
    """What tenant B's cached/baseline TTFT ratio says, from the number itself."""
    low, high = NOISE_BAND
    if ratio < low:
        return f"below {low}: tenant B's cached mode ran faster than its baseline, as if it reused chunks"
    if ratio > high:
        return f"above {high}: tenant B's cached mode ran slower than its baseline (cache overhead or noise)"
    return f"within {low}-{high}, about 1: tenant B got no speed-up from tenant A's chunks"


def print_report(results: dict[str, list[pb.GenerationResult]], model: str, threads: int, chunk_size: int,
                 runs: int) -> bool:
    """Prints the table and ratios; True when isolation held (B never cached, A always did)."""
    medians = {label: statistics.median(result.ttft_ms for result in rows) for label, rows in results.items()}
    prompt_tokens = results["A PREFIX_CACHE"][0].prompt_tokens
    print(f"\n{model}, CPU, {threads} thread(s) per service, chunk_size {chunk_size}, median of {runs} runs, "
          f"prompt {prompt_tokens} tokens, new question per run\n")
    header = f"{'tenant mode':<16} {'cached_tokens':>13} {'median TTFT ms':>14}"
    print(header)
    print("-" * len(header))
    for label, rows in results.items():
        cached = sorted({result.cached_tokens for result in rows})
        print(f"{label:<16} {'/'.join(map(str, cached)):>13} {medians[label]:>14.1f}")
    b_ratio = medians['B PREFIX_CACHE'] / medians['B BASELINE']
    print(f"\nB-cached / B-baseline: {b_ratio:.2f}x ({describe_b_ratio(b_ratio)})")
    print(f"B-baseline / A-cached: {medians['B BASELINE'] / medians['A PREFIX_CACHE']:.1f}x "
          "(tenant A's speed-up from its own chunks)")
    isolated = all(result.cached_tokens == 0 for result in results["B PREFIX_CACHE"] + results["B BASELINE"])
    reused = all(result.cached_tokens > 0 for result in results["A PREFIX_CACHE"])
    print(f"isolation {'held' if isolated and reused else 'BROKEN'}: B cached_tokens always 0, "
          f"A cached_tokens always > 0", flush=True)
    return isolated and reused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--context-tokens", type=int, default=1024, help="about this many tokens warmed through A")
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of each service (OMP_NUM_THREADS)")
    args = parser.parse_args(argv)
    if args.runs < 5:
        parser.error("medians need at least 5 runs")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the services inherit it; torch sizes its pool by it
    context, prompts = build_prompts(args.model, args.context_tokens, args.chunk_size, args.runs)
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-isolation-")))
        daemon_address, addresses = start_stack(stack, args.model, args.chunk_size, work_dir)
        channels = [stack.enter_context(grpc.insecure_channel(address)) for address in [daemon_address, *addresses]]
        cache_stub = cache_pb2_grpc.CacheServiceStub(channels[0])
        stubs = [inference_pb2_grpc.InferenceServiceStub(channel) for channel in channels[1:]]
        results = measure(stubs, cache_stub, context, prompts, args.runs)
    return 0 if print_report(results, args.model, args.threads, args.chunk_size, args.runs) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
