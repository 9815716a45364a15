"""Routing policies (round-robin, least-loaded, prefix-aware) on replicas whose L1s cannot each hold the working set.

Per policy a fresh loopback stack: N replicas (a daemon with an L1 of about 5 documents, a service with one thread)
behind `python -m router` (optionally every daemon on one redis-server as L2); clients ask about random documents for
--warmup seconds, then --duration measured: prompt tokens by source, cacheable tokens from L1, p50/p99 TTFT, req/s,
requests per replica. `vllm-POLICY` runs the real vllm-router over HTTP instead (replicas publish KV events);
`--overhead` / `--overhead-vllm ROUNDS`: one replica's TTFT direct against through the router.

    flock /tmp/kvboost-bench.lock python bench/bench_router.py --json bench/results/router.json --plot docs/router.png
    flock /tmp/kvboost-bench.lock python bench/bench_router.py --overhead 40   # the router's own cost, 1 replica
    python bench/bench_router.py --model tiny --replicas 2 --documents 4 --warmup 2 --duration 4   # smoke
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench import harness  # noqa: E402
from kvboost.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402
from kvboost.v1 import inference_pb2 as pb  # noqa: E402
from kvboost.v1 import inference_pb2_grpc  # noqa: E402

POLICIES = ("round-robin", "least-loaded", "prefix")
L1_DOCUMENTS = 5  # documents one daemon's L1 budget holds: the working set fits no one replica
BYTES_PER_VALUE = 4  # CPU serving keeps K/V in float32, and 16-bit storage stores them as computed


@dataclass
class Sample:
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    cacheable_tokens: int  # the document's whole chunks: what an L1 holding the document gives


@dataclass
class PolicyReport:
    policy: str
    l2: bool
    requests: int = 0
    errors: int = 0
    requests_per_s: float = 0.0
    ttft_ms_p50: float = 0.0
    ttft_ms_p99: float = 0.0
    share_l1: float = 0.0  # of measured prompt tokens
    share_l2: float = 0.0
    share_computed: float = 0.0
    cacheable_from_l1: float = 0.0  # of the cacheable tokens, those from the chosen replica's L1
    per_replica: list[int] = field(default_factory=list)  # requests each replica served while measured
    spread: float = 0.0  # max / min of per_replica


def summarize(policy: str, l2: bool, samples: list[Sample], errors: int, seconds: float, l2_tokens: int,
              per_replica: list[int]) -> PolicyReport:
    """The report of one measured phase. l2_tokens: tokens the daemons promoted from L2 meanwhile."""
    prompt = sum(sample.prompt_tokens for sample in samples) or 1
    cached = sum(sample.cached_tokens for sample in samples)
    from_l1 = max(0, cached - l2_tokens)
    cacheable = sum(sample.cacheable_tokens for sample in samples) or 1
    cacheable_l1 = sum(min(sample.cached_tokens, sample.cacheable_tokens) for sample in samples) - l2_tokens
    ttfts = [sample.ttft_ms for sample in samples]
    return PolicyReport(
        policy=policy, l2=l2, requests=len(samples), errors=errors, requests_per_s=len(samples) / seconds,
        ttft_ms_p50=harness.percentile(ttfts, 0.5) if ttfts else 0.0,
        ttft_ms_p99=harness.percentile(ttfts, 0.99) if ttfts else 0.0,
        share_l1=from_l1 / prompt, share_l2=l2_tokens / prompt, share_computed=(prompt - cached) / prompt,
        cacheable_from_l1=max(0, cacheable_l1) / cacheable, per_replica=per_replica,
        spread=max(per_replica) / max(1, min(per_replica)) if per_replica else 0.0)


def documents(count: int, sheets_per_document: int, seed: int = 11) -> list[str]:
    """count documents of sheets_per_document fact sheets each (~100 SmolLM2 tokens a sheet), distinct openings."""
    from rag_dataset import build_documents, document_segment

    sheets = [document_segment(document) for document in build_documents()]
    rng = random.Random(seed)
    return [f"Document {index + 1} of the archive.\n" + "\n".join(rng.sample(sheets, sheets_per_document))
            for index in range(count)]


class Clients:
    """Threads asking questions about random documents through the router until stopped; samples are kept
    only while `measuring` is set."""

    def __init__(self, address: str, texts: list[str], cacheable: list[int], num_clients: int,
                 max_new_tokens: int) -> None:
        self.address, self.texts, self.cacheable = address, texts, cacheable
        self.max_new_tokens = max_new_tokens
        self.samples: list[Sample] = []
        self.errors = 0
        self.measuring = threading.Event()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(seed,), daemon=True) for seed in range(num_clients)]

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=600)

    def _run(self, seed: int) -> None:
        rng, turn = random.Random(seed), 0
        with self.connect() as ask:
            while not self.stopping.is_set():
                index, turn = rng.randrange(len(self.texts)), turn + 1
                measured = self.measuring.is_set()
                try:
                    ttft_ms, prompt_tokens, cached_tokens = ask(
                        f"{self.texts[index]}\nQuestion {seed}.{turn}: which sheet names a keeper?\nAnswer:")
                except (grpc.RpcError, RuntimeError):
                    if measured:
                        self.errors += 1
                    continue
                if measured and self.measuring.is_set():
                    self.samples.append(Sample(ttft_ms, prompt_tokens, cached_tokens, self.cacheable[index]))

    @contextmanager
    def connect(self):
        """ask(prompt) -> (TTFT ms, prompt tokens, cached tokens) of one streamed Generate through the router."""
        with grpc.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)

            def ask(prompt: str) -> tuple[float, int, int]:
                started, first, result = time.perf_counter(), None, None
                for event in stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=self.max_new_tokens),
                                           timeout=600):
                    first = first or time.perf_counter()
                    result = event.result if event.HasField("result") else None
                if result is None:
                    raise RuntimeError("the stream ended without a result")
                return (first - started) * 1000, result.prompt_tokens, result.cached_tokens

            yield ask


def start_replicas(stack: ExitStack, workdir: Path, model: str, num_replicas: int, budget: int, chunk_size: int,
                   l2_url: str | None, service_flags=lambda index: ()) -> list[tuple[str, str]]:
    """Each replica's daemon, then every service at once (a start is mostly imports and loading, waited on)."""
    l2 = ("--l2", l2_url) if l2_url else ()
    daemons = [harness.start_daemon(stack, workdir, "--max-bytes", str(budget), *l2, name=f"lmdb-{index}")
               for index in range(num_replicas)]

    def start(index: int):  # every started service is stopped with the stack, even when another failed to start
        return harness.start_service(stack, model, daemons[index].address, workdir, "--chunk-size", str(chunk_size),
                                     "--threads", "1", *service_flags(index), name=f"service-{index}")

    with ThreadPoolExecutor(num_replicas) as starting:
        services = list(starting.map(start, range(num_replicas)))
    return [(service.address, daemon.address) for service, daemon in zip(services, daemons)]


def counters(pairs: list[tuple[str, str]]) -> tuple[list[int], int]:
    """(requests each service has served, chunks all daemons promoted from L2) so far."""
    requests, promoted = [], 0
    for service, daemon in pairs:
        with grpc.insecure_channel(service) as channel:
            stats = inference_pb2_grpc.InferenceServiceStub(channel).Stats(pb.ServiceStatsRequest(), timeout=30)
            requests.append(stats.requests)
        with grpc.insecure_channel(daemon) as channel:
            promoted += cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.CacheStatsRequest(), timeout=30).l2.hits
    return requests, promoted


def run_policy(args, policy: str, l2_url: str | None, model: str, texts: list[str], budget: int,
               workdir: Path) -> PolicyReport:
    from tests.conftest import pick_free_port
    from tests.e2e.router_process import start_router

    with ExitStack() as stack:
        if policy.startswith("vllm-"):
            pairs, router, _ = start_vllm_stack(stack, workdir, model, args.replicas, budget, args.chunk_size, l2_url,
                                                policy.removeprefix("vllm-"))
            client_type = HttpClients
        else:
            pairs = start_replicas(stack, workdir, model, args.replicas, budget, args.chunk_size, l2_url)
            router = start_router(pairs, pick_free_port(), pick_free_port(), workdir / "router.log", "--policy", policy)
            stack.callback(router.terminate)
            client_type = Clients
        with grpc.insecure_channel(pairs[0][0]) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            counts = [len(stub.Tokenize(pb.TokenizeRequest(prompt=text), timeout=60).token_ids) for text in texts]
        cacheable = [count - count % args.chunk_size for count in counts]
        with client_type(router.address, texts, cacheable, args.clients, args.max_new_tokens) as clients:
            time.sleep(args.warmup)
            requests_before, promoted_before = counters(pairs)
            clients.measuring.set()
            started = time.monotonic()
            time.sleep(args.duration)
            clients.measuring.clear()
            seconds = time.monotonic() - started
            requests_after, promoted_after = counters(pairs)
        served = [after - before for after, before in zip(requests_after, requests_before)]
        return summarize(policy, l2_url is not None, clients.samples, clients.errors, seconds,
                         (promoted_after - promoted_before) * args.chunk_size, served)


class HttpClients(Clients):
    """The same questions as streamed HTTP completions (through vllm-router to the replicas' gateways)."""

    @contextmanager
    def connect(self):
        import httpx

        with httpx.Client(base_url=self.address, timeout=600) as client:
            def ask(prompt: str) -> tuple[float, int, int]:
                try:
                    ttft_ms, usage = stream_completion(client, prompt, self.max_new_tokens)
                except httpx.HTTPError as error:
                    raise RuntimeError(str(error)) from error
                return ttft_ms, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0)

            yield ask


def stream_completion(client, prompt: str, max_tokens: int) -> tuple[float, dict]:
    """(ms to the first text chunk, the usage) of one streamed completion."""
    started, first, usage = time.perf_counter(), None, None
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:200]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    if first is None or usage is None:
        raise RuntimeError("the stream ended without text or usage")
    return (first - started) * 1000, usage


def start_vllm_stack(stack: ExitStack, workdir: Path, model: str, num_replicas: int, budget: int, chunk_size: int,
                     l2_url: str | None, policy: str):
    """Replicas publishing KV events, a gateway each, and vllm-router (with `policy`) in front of the gateways."""
    from tests.conftest import pick_free_port
    from tests.e2e.gateway_process import launch_gateway, wait_until_answering
    from tests.e2e.vllm_router_process import EventSource, start_vllm_router

    sockets = [(f"tcp://127.0.0.1:{pick_free_port()}", f"tcp://127.0.0.1:{pick_free_port()}")
               for _ in range(num_replicas)]
    pairs = start_replicas(stack, workdir, model, num_replicas, budget, chunk_size, l2_url,
                           lambda index: ("--kv-events-endpoint", sockets[index][0],
                                          "--kv-events-replay-endpoint", sockets[index][1],
                                          # L0 advertises; sized as L1 so it holds about what the daemon does
                                          # (L0's chunks are placed only while the daemon's Lookup confirms them)
                                          "--l0-bytes", str(budget)))
    sources = []
    for index, (service, _) in enumerate(pairs):
        gateway = launch_gateway(service, pick_free_port(), workdir / f"gateway-{index}.log",
                                 "--served-model-name", "bench")
        stack.callback(gateway.terminate)
        wait_until_answering(gateway)
        sources.append(EventSource(gateway.base_url, *sockets[index]))
    router = start_vllm_router(sources, workdir / "vllm-router.log", policy, model="bench")
    stack.callback(router.terminate)
    return pairs, router, [source.worker_url for source in sources]


def measure_overhead(model: str, text: str, budget: int, chunk_size: int, rounds: int, workdir: Path,
                     vllm: bool = False) -> tuple[float, float]:
    """(p50 TTFT direct, p50 TTFT through the router) on one replica: the document warmed, then a new question each
    round, asked directly and through the router in turn; vllm: its gateway and vllm-router over HTTP."""
    from tests.conftest import pick_free_port
    from tests.e2e.router_process import start_router

    with ExitStack() as stack:
        if vllm:
            _, router, (gateway,) = start_vllm_stack(stack, workdir, model, 1, budget, chunk_size, None, "kv_aware")
            clients = {"direct": HttpClients(gateway, [], [], 0, 1), "routed": HttpClients(router.address, [], [], 0, 1)}
        else:
            pairs = start_replicas(stack, workdir, model, 1, budget, chunk_size, None)
            router = start_router(pairs, pick_free_port(), pick_free_port(), workdir / "router.log")
            stack.callback(router.terminate)
            clients = {"direct": Clients(pairs[0][0], [], [], 0, 1), "routed": Clients(router.address, [], [], 0, 1)}
        asks = {name: stack.enter_context(client.connect()) for name, client in clients.items()}
        asks["direct"](text)  # the document warmed
        turn = iter(range(1 << 30))
        times = harness.alternate({name: lambda ask=ask: ask(f"{text}\nQuestion {next(turn)}: who keeps it?\nAnswer:")[0]
                                   for name, ask in asks.items()}, rounds)
        return harness.median(times["direct"]), harness.median(times["routed"])


def bytes_per_token(model_path: str) -> int:
    from transformers import AutoConfig

    from inference_service.kv_memory.kv_buffers import kv_geometry

    geometry = kv_geometry(AutoConfig.from_pretrained(model_path))
    return 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * BYTES_PER_VALUE


REPORT_COLUMNS = ("policy", ("l2", "L2"), ("requests", "req"), ("requests_per_s", "req/s"), ("ttft_ms_p50", "p50 ms"),
                  ("ttft_ms_p99", "p99 ms"), ("share_l1", "L1"), ("share_l2", "from L2"), ("share_computed", "computed"),
                  ("cacheable_from_l1", "cacheable from L1"), ("per_replica", "per replica"), "spread",
                  ("errors", "err"))


def format_report(reports: list[PolicyReport]) -> str:
    return harness.table([asdict(report) for report in reports], REPORT_COLUMNS)


def write_plot(reports: list[PolicyReport], path: Path) -> None:
    plt = harness.pyplot()
    labels = [f"{report.policy}{' +L2' if report.l2 else ''}" for report in reports]
    figure, (ttft_axis, share_axis) = plt.subplots(1, 2, figsize=(11, 4))
    positions = range(len(reports))
    ttft_axis.bar([p - 0.2 for p in positions], [r.ttft_ms_p50 for r in reports], 0.4, label="p50")
    ttft_axis.bar([p + 0.2 for p in positions], [r.ttft_ms_p99 for r in reports], 0.4, label="p99")
    ttft_axis.set_xticks(list(positions), labels, rotation=20)
    ttft_axis.set_yscale("log")  # a prefix hit and a full prefill differ fifty-fold
    ttft_axis.set_ylabel("TTFT, ms (log)")
    ttft_axis.legend()
    bottom = [0.0] * len(reports)
    for name, values in (("L1", [r.share_l1 for r in reports]), ("L2", [r.share_l2 for r in reports]),
                         ("computed", [r.share_computed for r in reports])):
        share_axis.bar(list(positions), values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    share_axis.set_xticks(list(positions), labels, rotation=20)
    share_axis.set_ylabel("share of prompt tokens")
    share_axis.legend()
    figure.suptitle("Routing policies: TTFT and where prompt tokens came from")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a catalogue name, a folder, or `tiny`")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--sheets", type=int, default=16, help="fact sheets per document (~100 SmolLM2 tokens each)")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of questions before measuring")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds measured")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--l2", action="store_true",
                        help="every daemon on one redis-server (emptied before each policy)")
    parser.add_argument("--overhead", type=int, default=0, metavar="ROUNDS",
                        help="instead of the policies: TTFT on one replica, direct against through the router")
    parser.add_argument("--overhead-vllm", type=int, default=0, metavar="ROUNDS",
                        help="instead of the policies: TTFT on one replica's gateway, direct against through vllm-router")
    harness.add_arguments(parser, rounds=None)
    parser.add_argument("--plot", type=Path, help="write a PNG here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    with tempfile.TemporaryDirectory(prefix="bench-router-") as scratch, ExitStack() as stack:
        workdir = Path(scratch)
        model = harness.model_path(args.model, workdir)
        from transformers import AutoTokenizer

        from inference_service.model.weights import resolve_model_path

        path = resolve_model_path(model)
        texts = documents(args.documents, args.sheets)
        tokenizer = AutoTokenizer.from_pretrained(path)
        mean_tokens = statistics.mean(len(tokenizer(text)["input_ids"]) for text in texts)
        budget = int(L1_DOCUMENTS * mean_tokens * bytes_per_token(path))
        print(f"{args.documents} documents of ~{mean_tokens:.0f} tokens; L1 budget {budget / 2**20:.0f} MiB per "
              f"daemon (~{L1_DOCUMENTS} documents)", flush=True)
        if args.overhead:
            direct, routed = measure_overhead(model, texts[0], budget, args.chunk_size, args.overhead, workdir)
            print(f"one replica, {args.overhead} rounds: p50 TTFT direct {direct:.1f} ms, through the router "
                  f"{routed:.1f} ms ({routed - direct:+.1f} ms)")
            return 0
        if args.overhead_vllm:
            direct, routed = measure_overhead(model, texts[0], budget, args.chunk_size, args.overhead_vllm, workdir,
                                              vllm=True)
            print(f"one replica over HTTP, {args.overhead_vllm} rounds: p50 TTFT direct to its gateway {direct:.1f} "
                  f"ms, through vllm-router {routed:.1f} ms ({routed - direct:+.1f} ms)")
            return 0
        l2_url = None
        if args.l2:
            from tests.conftest import pick_free_port
            from tests.redis_support import RedisNode

            # Room for every document (the tests' 512 MB would evict), and AOF without an fsync per write.
            node = RedisNode(pick_free_port(), workdir / "redis", cluster=False,
                             extra=("--maxmemory", "8gb", "--appendfsync", "everysec")).start()
            stack.callback(node.stop)
            l2_url = node.url
        reports = []
        for policy in args.policies.split(","):
            run_dir = workdir / policy
            run_dir.mkdir()
            if l2_url:  # every policy starts with an empty L2
                subprocess.run(["redis-cli", "-p", l2_url.rsplit(":", 1)[1], "FLUSHALL"], check=True,
                               capture_output=True)
            reports.append(run_policy(args, policy, l2_url, model, texts, budget, run_dir))
            print(format_report(reports[-1:]).splitlines()[-1], flush=True)
    print(format_report(reports))
    harness.write_json(args.json, [asdict(report) for report in reports])
    if args.plot:
        write_plot(reports, args.plot)
    return 0 if not any(report.errors for report in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
