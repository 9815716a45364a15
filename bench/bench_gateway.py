"""Overhead of the HTTP gateway: TTFT and streaming tokens/s through HTTP (SSE) against gRPC Generate, same run.

One cache daemon, one inference service and one gateway are started as processes on free loopback ports
(client.stack's own start/stop). A ~1536-token context (12 full chunks of 128) is warmed once; every pair
of runs then asks one new ~30-token question twice, once through gRPC (a persistent channel, first
GenerateEvent with tokens) and once through the gateway (a persistent HTTP connection, first SSE chunk
with text), in alternating order, PREFIX_CACHE, so both reuse the same 12 chunks and prefill the same
tail. Both paths time the same thing: the arrival of each piece of text (a gRPC event or an SSE chunk with
text; the gateway forwards exactly the service's pieces). Streaming rate: (tokens - 1) / (last - first
piece arrival) at the client, 128 tokens, EOS ignored.
Medians over the runs; the target is HTTP TTFT <= gRPC TTFT + 5 ms at p50, tokens/s within 5%.

    flock /tmp/kvboost-bench.lock python bench/bench_gateway.py [--runs 20] [--stream-runs 6] [--model PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402

from client import stack  # noqa: E402
from kvboost.v1 import inference_pb2 as pb  # noqa: E402
from kvboost.v1 import inference_pb2_grpc  # noqa: E402

TTFT_TARGET_MS = 5.0
RATE_TARGET = 0.05
PASSAGE = ("Section {n}. The maintenance handbook describes the pumping station in detail. Each of the four pumps "
           "is inspected weekly: bearings are checked for noise, seals for leaks, and the motor current is compared "
           "with the value on the nameplate. Valves are exercised monthly.\n")
SUBJECTS = ("pump", "valve", "seal", "alarm", "bearing", "motor", "log", "operator", "inventory", "building")


@dataclass(slots=True)
class Summary:
    ttft_grpc_ms: float
    ttft_http_ms: float
    ttft_paired_delta_ms: float  # median of (HTTP - gRPC) within each pair
    server_ttft_ms: float  # the service's own TTFT (request arrival to first token), gRPC runs
    rate_grpc: float  # tokens/s
    rate_http: float
    prompt_tokens: int
    cached_tokens: int
    runs: int
    stream_runs: int

    @property
    def ttft_met(self) -> bool:
        return self.ttft_http_ms <= self.ttft_grpc_ms + TTFT_TARGET_MS

    @property
    def rate_met(self) -> bool:
        return abs(self.rate_http / self.rate_grpc - 1.0) <= RATE_TARGET


def format_summary(summary: Summary) -> list[str]:
    rate_ratio = summary.rate_http / summary.rate_grpc
    return [
        f"prompt {summary.prompt_tokens} tokens, {summary.cached_tokens} cached; {summary.runs} TTFT pairs, "
        f"{summary.stream_runs} streaming pairs",
        f"{'path':<8} {'TTFT p50 ms':>12} {'stream tok/s p50':>17}",
        f"{'gRPC':<8} {summary.ttft_grpc_ms:>12.1f} {summary.rate_grpc:>17.1f}",
        f"{'HTTP':<8} {summary.ttft_http_ms:>12.1f} {summary.rate_http:>17.1f}",
        f"HTTP - gRPC TTFT: {summary.ttft_http_ms - summary.ttft_grpc_ms:+.1f} ms at p50 (paired median "
        f"{summary.ttft_paired_delta_ms:+.1f} ms; target <= +{TTFT_TARGET_MS:g} ms: "
        f"{'met' if summary.ttft_met else 'missed'}); service-side TTFT p50 {summary.server_ttft_ms:.1f} ms",
        f"HTTP / gRPC streaming rate: {rate_ratio:.3f} (target within {RATE_TARGET:.0%}: "
        f"{'met' if summary.rate_met else 'missed'})",
    ]


def build_context(tokenize, num_tokens: int) -> str:
    """Handbook text of exactly num_tokens tokens (tokenize: text -> token count, as the service counts)."""
    text, section = "", 0
    while tokenize(text) < num_tokens + 100:
        section += 1
        text += PASSAGE.format(n=section)
    low, high = 0, len(text)
    while low < high:  # the longest prefix with at most num_tokens tokens
        middle = (low + high + 1) // 2
        low, high = (middle, high) if tokenize(text[:middle]) <= num_tokens else (low, middle - 1)
    return text[:low]


def question(run: int) -> str:
    subject = SUBJECTS[run % len(SUBJECTS)]
    return f"\nQuestion {run:04d}: in one sentence, how often is the {subject} checked, and by whom?\nAnswer:"


class GrpcPath:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)

    def count_tokens(self, text: str) -> int:
        return len(self.stub.Tokenize(pb.TokenizeRequest(prompt=text), timeout=60).token_ids) if text else 0

    def stream(self, prompt: str, max_tokens: int) -> tuple[float, list[float], int, pb.GenerationResult]:
        """(send time, arrival time of each piece of text, tokens generated, result)."""
        start, arrivals, result = time.perf_counter(), [], None
        request = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_tokens, temperature=0, mode=pb.PREFIX_CACHE,
                                     ignore_eos=True)
        for event in self.stub.Generate(request, timeout=600):
            if event.text:
                arrivals.append(time.perf_counter())
            if event.HasField("result"):
                result = event.result
        return start, arrivals, result.generated_tokens, result


class HttpPath:
    def __init__(self, base_url: str) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=600)

    def stream(self, prompt: str, max_tokens: int) -> tuple[float, list[float], int, dict]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, "kvboost": {"mode": "prefix_cache"}}
        start, arrivals, usage = time.perf_counter(), [], {}
        with self.client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    arrivals.append(time.perf_counter())
        return start, arrivals, usage["completion_tokens"], usage


def rate(arrivals: list[float], num_tokens: int) -> float:
    return (num_tokens - 1) / (arrivals[-1] - arrivals[0])


def measure(grpc_path: GrpcPath, http_path: HttpPath, context: str, runs: int, stream_runs: int,
            stream_tokens: int) -> Summary:
    ttft = {"grpc": [], "http": []}
    deltas, server_ttft, result = [], [], None
    for run in range(runs):
        prompt = context + question(run)
        order = ("grpc", "http") if run % 2 == 0 else ("http", "grpc")
        pair = {}
        for path in order:
            if path == "grpc":
                start, arrivals, _, result = grpc_path.stream(prompt, 1)
                server_ttft.append(result.ttft_ms)
            else:
                start, arrivals, _, _ = http_path.stream(prompt, 1)
            pair[path] = (arrivals[0] - start) * 1000
            ttft[path].append(pair[path])
        deltas.append(pair["http"] - pair["grpc"])
    rates = {"grpc": [], "http": []}
    for run in range(stream_runs):
        prompt = context + question(runs + run)
        for path in (("grpc", "http") if run % 2 == 0 else ("http", "grpc")):
            _, arrivals, num_tokens, _ = (grpc_path if path == "grpc" else http_path).stream(prompt, stream_tokens)
            rates[path].append(rate(arrivals, num_tokens))
    return Summary(statistics.median(ttft["grpc"]), statistics.median(ttft["http"]), statistics.median(deltas),
                   statistics.median(server_ttft), statistics.median(rates["grpc"]), statistics.median(rates["http"]),
                   result.prompt_tokens, result.cached_tokens, runs, stream_runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model name or path (default: the service's, SmolLM2-135M-Instruct)")
    parser.add_argument("--context-tokens", type=int, default=1536, help="warmed context (default 12 chunks of 128)")
    parser.add_argument("--runs", type=int, default=20, help="TTFT pairs (default %(default)s)")
    parser.add_argument("--stream-runs", type=int, default=6, help="streaming pairs (default %(default)s)")
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens per streaming run (default %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kvboost-bench-gateway-") as run_dir:
        ports = [f"127.0.0.1:{port}" for port in _free_ports(3)]
        stack_args = stack.build_parser().parse_args(
            ["up", "--run-dir", run_dir, "--address", ports[0], "--daemon-address", ports[1],
             "--gateway-address", ports[2]] + (["--model", args.model] if args.model else []))
        components = stack.build_components(stack_args)
        (Path(run_dir) / "lmdb").mkdir()
        started = []
        try:
            for component in components:
                stack.start(component, Path(run_dir), timeout_s=600)
                started.append(component)
            grpc_path, http_path = GrpcPath(ports[0]), HttpPath(f"http://{ports[2]}")
            context = build_context(grpc_path.count_tokens, args.context_tokens)
            grpc_path.stub.Warm(pb.WarmRequest(text=context), timeout=600)
            for path in (grpc_path, http_path):  # warm-up: first connections, first forward passes
                path.stream(context + question(9999), 2)
            summary = measure(grpc_path, http_path, context, args.runs, args.stream_runs, args.stream_tokens)
        finally:
            for component in reversed(started):
                stack.stop(component, Path(run_dir), grace_s=15)
    print(f"bench_gateway {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
          f"{' '.join(['python', 'bench/bench_gateway.py', *(argv if argv is not None else sys.argv[1:])])}")
    print("\n".join(format_summary(summary)))
    if args.json:
        from dataclasses import asdict
        args.json.write_text(json.dumps(asdict(summary), indent=2) + "\n")
    return 0


def _free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


if __name__ == "__main__":
    sys.exit(main())
