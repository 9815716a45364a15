"""TTFT on SmolLM2 (CPU) of a warmed document plus a new question, per path to the cached K/V, against BASELINE.

Each length's document (not a whole number of chunks) is warmed once per path; every run asks a new question, paths
alternating with BASELINE; TTFT from request arrival. Engine rows: the Engine in this process over an in-process store,
the daemon read co-located, its Fetch stream over TCP and over a unix socket. Service rows: a running `python -m
inference_service` asked over gRPC (TTFT at the client, the service's own beside it). --tiers: L1 hits through a
daemon without and with a Redis L2, and L2 hits on a second daemon whose LMDB never saw the document.

    python bench/bench_ttft.py                       # 512/1600/3000 tokens, every path, 5 runs
    flock /tmp/kvboost-bench.lock python bench/bench_ttft.py --tiers --lengths 1600 --lookup-timeout 1
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

import grpc  # noqa: E402
import torch  # noqa: E402

from bench import harness  # noqa: E402
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams  # noqa: E402
from inference_service.model.loading import load_model  # noqa: E402
from inference_service.model.weights import DEFAULT_MODEL  # noqa: E402
from inference_service.store.colocated import ColocatedStore  # noqa: E402
from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions  # noqa: E402
from inference_service.store.memory import InMemoryStore  # noqa: E402
from kvboost.v1 import cache_pb2  # noqa: E402
from kvboost.v1 import inference_pb2 as pb  # noqa: E402
from kvboost.v1 import inference_pb2_grpc  # noqa: E402

QUESTION_TOKENS = 30
PASSAGE = (
    "Section {n}. The maintenance handbook describes the pumping station in detail. Each of the four "
    "pumps is inspected weekly: bearings are checked for noise, seals for leaks, and the motor current is "
    "compared with the value on the nameplate. Valves are exercised monthly. The control room keeps a log "
    "of alarms, with the time, the operator on duty and the action taken. Spare parts are stored in the "
    "east building, sorted by pump number, and the inventory is counted at the end of every quarter.\n"
)
SUBJECTS = ("pump", "valve", "seal", "alarm", "bearing", "motor", "log", "operator", "inventory", "building")


def build_context(tokenizer, num_tokens: int) -> str:
    """Handbook text that tokenizes to exactly num_tokens tokens, also when a question follows it."""
    text, section = "", 0
    while len(tokenizer(text)["input_ids"]) < num_tokens + 200:
        section += 1
        text += PASSAGE.format(n=section)
    ids = tokenizer(text)["input_ids"]
    for start in range(200):  # a cut whose tokens survive re-tokenizing next to the question
        context = tokenizer.decode(ids[start : start + num_tokens])
        if tokenizer(context + question(0))["input_ids"][:num_tokens] == ids[start : start + num_tokens]:
            return context
    raise RuntimeError(f"no cut of the handbook keeps its {num_tokens} tokens")


def question(run: int) -> str:
    """A question no earlier run asked (about QUESTION_TOKENS tokens), starting a new line."""
    subject = SUBJECTS[run % len(SUBJECTS)]
    return (f"\nQuestion {run * 7919 % 10007}: according to the handbook, how often is the {subject} checked, "
            "who records it, and where is it kept? Answer:")


class EnginePath:
    """The Engine in this process over one store."""

    def __init__(self, name: str, loaded, config: EngineConfig, store) -> None:
        self.name = name
        self.engine = Engine(loaded.model, loaded.tokenizer, config, store, model_id=loaded.model_id)
        self.engine.generate(GenerationParams(prompt="Warm-up.", max_new_tokens=1, mode="baseline"))

    def warm(self, context: str) -> None:
        self.engine.warm(context)

    def ask(self, prompt: str, mode: str | None) -> dict:
        outcome = self.engine.generate(GenerationParams(prompt=prompt, max_new_tokens=1, mode=mode))
        self.engine.flush_writes()  # the question's write-back never overlaps the next request
        assert not outcome.degraded, f"{self.name}: the cache was unreachable during the benchmark"
        return {"ttft_ms": outcome.ttft_ms, "cached": outcome.cached_tokens, "prompt": outcome.prompt_tokens}

    def close(self) -> None:
        self.engine.close()


class ServicePath:
    """A running `python -m inference_service`, asked over gRPC as a user's client asks it."""

    def __init__(self, name: str, stack: ExitStack, workdir: Path, daemon_address: str, model: str,
                 chunk_size: int, *flags: str) -> None:
        from tests.conftest import pick_free_port
        from tests.e2e.service_process import running_service

        self.name = name
        service = stack.enter_context(running_service(model, daemon_address, pick_free_port(),
                                                      workdir / f"{name}.log", "--chunk-size", str(chunk_size),
                                                      *flags, timeout_s=300))
        self.channel = stack.enter_context(grpc.insecure_channel(service.address))
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self.ask("Warm-up.", "baseline")

    def warm(self, context: str) -> None:
        self.stub.Warm(pb.WarmRequest(text=context), timeout=600)

    def ask(self, prompt: str, mode: str | None) -> dict:
        request = pb.GenerateRequest(prompt=prompt, max_new_tokens=1,
                                     mode=pb.Mode.Value(mode.upper()) if mode else pb.MODE_UNSPECIFIED)
        started = time.perf_counter()
        first = None
        for event in self.stub.Generate(request, timeout=600):
            first = first or time.perf_counter()
            if event.HasField("result"):
                result = event.result
        assert not result.degraded, f"{self.name}: the cache was unreachable during the benchmark"
        return {"ttft_ms": (first - started) * 1000, "server_ttft_ms": result.ttft_ms,
                "cached": result.cached_tokens, "prompt": result.prompt_tokens}

    def close(self) -> None:
        pass


def start_daemons(stack: ExitStack, workdir: Path) -> tuple[str, str]:
    """Two daemons with their own data: one on a loopback port, one on a unix socket."""
    from tests.e2e.daemon_process import start_daemon

    tcp = harness.start_daemon(stack, workdir, "--max-bytes", "8GB", name="lmdb-tcp")
    unix = start_daemon(workdir / "lmdb-unix", f"unix:{workdir / 'daemon.sock'}", "--max-bytes", "8GB")
    stack.callback(unix.terminate)
    return tcp.address, unix.address


def grpc_store(stack: ExitStack, address: str, rpc_timeout_s: float | None = None) -> GrpcChunkStore:
    timeouts = {} if rpc_timeout_s is None else {"rpc_timeout_s": rpc_timeout_s}
    store = GrpcChunkStore(GrpcStoreOptions(address=address, fetch_timeout_s=60.0, store_timeout_s=60.0, **timeouts))
    stack.callback(store.close)
    assert store.check(), f"cache daemon at {address} does not answer"
    return store


def build_paths(args, stack: ExitStack, workdir: Path, loaded) -> list:
    config = EngineConfig(chunk_size=args.chunk_size, kv_cache_bits=args.kv_cache_bits)
    paths = [EnginePath("in-process", loaded, config, InMemoryStore())]
    if args.no_daemon:
        return paths
    tcp, unix = start_daemons(stack, workdir)
    colocated = ColocatedStore(grpc_store(stack, tcp), "on")
    colocated.check()
    paths += [EnginePath("co-located", loaded, config, colocated),
              EnginePath("tcp stream", loaded, config, grpc_store(stack, tcp)),
              EnginePath("unix stream", loaded, config, grpc_store(stack, unix))]
    if not args.no_service:
        common = (args.model, args.chunk_size, "--kv-cache-bits", str(args.kv_cache_bits))
        paths += [ServicePath("service co-located", stack, workdir, tcp, *common, "--cache-local-read", "on"),
                  ServicePath("service tcp", stack, workdir, tcp, *common, "--cache-local-read", "off"),
                  ServicePath("service unix", stack, workdir, unix, *common, "--cache-local-read", "off")]
    return paths


def measure(paths: list, context: str, runs: int) -> dict[str, list[dict]]:
    """Per run: BASELINE in the engine (and through the first service), then each path's cached request."""
    for path in paths:
        path.warm(context)
    services = [path for path in paths if isinstance(path, ServicePath)]
    subjects = {"baseline": (paths[0], "baseline")} | (
        {"service baseline": (services[0], "baseline")} if services else {})
    subjects |= {path.name: (path, None if isinstance(path, ServicePath) else "prefix_cache") for path in paths}
    asked = iter(range(1 << 30))  # a fresh question for every request
    return harness.alternate({name: lambda path=path, mode=mode: path.ask(context + question(next(asked)), mode)
                              for name, (path, mode) in subjects.items()}, runs)


def summarize(length: int, samples: dict[str, list[dict]]) -> list[dict]:
    """Median TTFT per path; engine rows against the engine's BASELINE, service rows against the service's."""
    median_of = {name: harness.median(s["ttft_ms"] for s in rows) for name, rows in samples.items()}
    in_process = median_of.get("in-process", median_of["baseline"])
    rows = []
    for name, rows_of_path in samples.items():
        median = median_of[name]
        baseline = median_of["service baseline" if name.startswith("service") else "baseline"]
        server = [s["server_ttft_ms"] for s in rows_of_path if "server_ttft_ms" in s]
        rows.append({"length": length, "path": name, "prompt_tokens": rows_of_path[-1]["prompt"],
                     "cached_tokens": rows_of_path[-1]["cached"], "median_ms": median,
                     "server_median_ms": harness.median(server) if server else None,
                     "x_baseline": f"{baseline / median:.1f}x", "x_in_process": f"{median / in_process:.2f}x",
                     "ttft_ms": [s["ttft_ms"] for s in rows_of_path]})
    return rows


def start_tier_daemons(stack: ExitStack, workdir: Path, redis_url: str) -> dict[str, str]:
    return {name: harness.start_daemon(stack, workdir, "--max-bytes", "8GB", *flags, name=f"lmdb-{name}").address
            for name, flags in (("P", ()), ("A", ("--l2", redis_url)), ("B", ("--l2", redis_url)))}


def engine_over(stack: ExitStack, name: str, loaded, config: EngineConfig, address: str,
                lookup_timeout_s: float) -> EnginePath:
    store = ColocatedStore(grpc_store(stack, address, lookup_timeout_s), "on")
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


def measure_tiers(paths: dict[str, EnginePath], stub_a, context: str, runs: int) -> dict[str, list[dict]]:
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


def write_plot(rows: list[dict], path: Path) -> None:
    plt = harness.pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["path"] for r in rows):
        points = [r for r in rows if r["path"] == name]
        axis.plot([r["prompt_tokens"] for r in points], [r["median_ms"] for r in points], marker="o", label=name,
                  linestyle="--" if name.startswith("service") else "-")
    axis.set_xlabel("prompt tokens (warmed document + new question)")
    axis.set_ylabel("median TTFT (ms)")
    axis.set_yscale("log")
    axis.set_title("SmolLM2-135M TTFT by path to the cached K/V, CPU fp32")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def run_tiers(args, loaded) -> None:
    """The --tiers run: P, A and B alternating, medians, and the targets' lines."""
    from tests.daemon_support import cache_stub
    from tests.redis_support import redis_node

    config = EngineConfig(chunk_size=args.chunk_size)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-tiers-")))
        redis = stack.enter_context(redis_node(workdir / "redis"))
        addresses = start_tier_daemons(stack, workdir, redis.url)
        paths = {name: engine_over(stack, name, loaded, config, addresses[daemon], args.lookup_timeout)
                 for name, daemon in (("L1 hit, no L2", "P"), ("L1 hit, L2 on", "A"), ("L2 hit", "B"))}
        paths["warm on A"] = paths["L1 hit, L2 on"]
        stub_a = stack.enter_context(cache_stub(addresses["A"]))
        context = build_context(loaded.tokenizer, args.lengths[0] - QUESTION_TOKENS)
        samples = measure_tiers(paths, stub_a, context, args.runs)
        with cache_stub(addresses["B"]) as stub_b:
            b_stats = l2_stats(stub_b)
        a_stats = l2_stats(stub_a)
    medians = {name: harness.median(s["ttft_ms"] for s in rows) for name, rows in samples.items()}
    harness.print_table(f"bench_ttft --tiers: {loaded.model_id}, CPU fp32, {torch.get_num_threads()} threads, chunk_size "
                        f"{args.chunk_size}, ~{args.lengths[0]}-token prompts, median of {args.runs} alternating runs, "
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or path (default: the embedded SmolLM2)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1600, 3000], help="prompt tokens")
    parser.add_argument("--runs", type=int, default=5, help="requests per path and length (medians; at least 5)")
    parser.add_argument("--chunk-size", type=int, default=128, help="tokens per cached chunk")
    parser.add_argument("--no-daemon", action="store_true", help="the in-process store only")
    parser.add_argument("--no-service", action="store_true", help="engine rows only (no service processes)")
    parser.add_argument("--kv-cache-bits", type=int, choices=(16, 8, 4), default=16, help="storage width")
    parser.add_argument("--threads", type=int, help="torch CPU threads in this process (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where JSON and PNG go")
    parser.add_argument("--tiers", action="store_true", help="the cache tiers instead of the paths: L1 hits with and "
                        "without L2, and L2 hits on a second daemon, at the first of --lengths")
    parser.add_argument("--lookup-timeout", type=float, default=10.0, help="with --tiers: seconds for a Lookup (the "
                        "service's --cache-timeout, 1 s by default)")
    args = parser.parse_args(argv)
    assert args.runs >= 5, "medians need at least 5 runs"
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, device="cpu", dtype="float32")
    if args.tiers:
        return run_tiers(args, loaded)
    rows: list[dict] = []
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ttft-")))
        paths = build_paths(args, stack, workdir, loaded)
        for length in args.lengths:
            context = build_context(loaded.tokenizer, length - QUESTION_TOKENS)
            length_rows = summarize(length, measure(paths, context, args.runs))
            rows += length_rows
            print(f"  {length} tokens: " + ", ".join(f"{r['path']} {r['median_ms']:.1f} ms" for r in length_rows),
                  flush=True)
        for path in paths:
            path.close()
    harness.print_table(
        f"bench_ttft: {loaded.model_id}, CPU fp32, {torch.get_num_threads()} threads, MKL dispatch "
        f"{MKL_DISPATCH.applied}, chunk_size {args.chunk_size}, {args.kv_cache_bits}-bit storage, "
        "unaligned documents, median of {args.runs} alternating runs, a new "
        f"~{QUESTION_TOKENS}-token question per run", rows,
        ["path", ("prompt_tokens", "prompt"), ("cached_tokens", "cached"), ("median_ms", "TTFT ms"),
         ("server_median_ms", "server ms"), ("x_baseline", "x BASELINE"), ("x_in_process", "/ in-proc")], digits=1)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    harness.write_json(args.out / f"ttft-{stamp}.json", rows)
    write_plot(rows, args.out / f"ttft-{stamp}.png")
    print(f"\nwrote {args.out}/ttft-{stamp}.json and .png")


if __name__ == "__main__":
    main()
