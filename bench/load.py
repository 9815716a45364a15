"""Bounded load generator for the KVBoost stack: N concurrent clients for D seconds on loopback only, then it stops.

Each client loops Generate on a long shared system prompt plus its own question. Reported: p50/p99 TTFT (client and
server), errors (target 0), RESOURCE_EXHAUSTED rejections apart, the daemon's RSS and LMDB size before and after, and
its byte budget sampled every 0.25 s (never exceeded).

    python bench/load.py                                  # starts its own stack (SmolLM2), 16 clients, 60 s
    python bench/load.py --address 127.0.0.1:50051 --daemon-address 127.0.0.1:50052 --daemon-pid PID \
        --data-dir ~/.cache/kvboost/cache-daemon          # against a running stack
"""
from __future__ import annotations

import argparse
import itertools
import ipaddress
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench import harness  # noqa: E402
from kvboost.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402
from kvboost.v1 import inference_pb2 as pb  # noqa: E402
from kvboost.v1 import inference_pb2_grpc  # noqa: E402

_RUN_NUMBERS = itertools.count(1)
_ROUTES = ["north pier", "old town", "lighthouse", "fish market", "island camp", "university"]
SYSTEM_PROMPT = "\n".join(
    ["You are the help desk of the Harbour Town ferry service. Answer in one short sentence."]
    + [f"Rule {i + 1}: the ferry to the {_ROUTES[i % len(_ROUTES)]} leaves at {6 + i % 12}:{(i * 7) % 60:02d} "
       f"from gate {i % 9 + 1}; bicycles cost {2 + i % 5} euros." for i in range(24)]
)


@dataclass
class Report:
    clients: int
    duration_s: float
    requests: int = 0
    errors: int = 0
    rejected: int = 0  # RESOURCE_EXHAUSTED: the service's queue was full (back-pressure, not an error)
    error_messages: list[str] = field(default_factory=list)
    ttft_ms_p50: float = 0.0
    ttft_ms_p99: float = 0.0
    server_ttft_ms_p50: float = 0.0
    server_ttft_ms_p99: float = 0.0
    mean_kv_reuse_ratio: float = 0.0
    requests_per_s: float = 0.0
    output_tokens: int = 0
    output_tokens_per_s: float = 0.0
    time_per_output_token_ms_p50: float = 0.0  # server-side decode time per token after the first
    daemon_rss_before_bytes: int | None = None
    daemon_rss_after_bytes: int | None = None
    daemon_anon_rss_before_bytes: int | None = None  # RssAnon: the daemon's own heap
    daemon_anon_rss_after_bytes: int | None = None
    lmdb_bytes_before: int | None = None
    lmdb_bytes_after: int | None = None
    budget_bytes: int | None = None
    max_stored_bytes_seen: int | None = None
    budget_samples: int = 0
    budget_exceeded: bool = False


def require_loopback(address: str) -> None:
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"load.py runs on loopback only; refusing {address!r}")


def percentile(values: list[float], fraction: float) -> float:
    return harness.percentile(values, fraction) if values else 0.0


def dir_bytes(folder: Path | None) -> int | None:
    if folder is None or not folder.exists():
        return None
    return sum(path.stat().st_blocks * 512 for path in folder.rglob("*") if path.is_file())


class Client(threading.Thread):
    def __init__(self, address: str, index: int, deadline: float, max_new_tokens: int, timeout_s: float,
                 run_tag: str = "") -> None:
        super().__init__(daemon=True)
        self.address, self.index, self.deadline, self.run_tag = address, index, deadline, run_tag
        self.max_new_tokens, self.timeout_s = max_new_tokens, timeout_s
        self.ttft_ms: list[float] = []
        self.server_ttft_ms: list[float] = []
        self.reuse: list[float] = []
        self.generated_tokens: list[int] = []
        self.time_per_output_token_ms: list[float] = []
        self.errors: list[str] = []
        self.rejected = 0

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            request_index = 0
            while time.monotonic() < self.deadline:
                question = f"\nQuestion {self.run_tag}{self.index}.{request_index}: when does the ferry to the " \
                           f"{_ROUTES[(self.index + request_index) % len(_ROUTES)]} leave?\nAnswer:"
                request_index += 1
                self._one(stub, SYSTEM_PROMPT + question)

    def _one(self, stub, prompt: str) -> None:
        started = time.perf_counter()
        first = None
        result = None
        try:
            for event in stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=self.max_new_tokens),
                                       timeout=self.timeout_s):
                if first is None and (event.token_ids or event.text):
                    first = time.perf_counter()
                if event.HasField("result"):
                    result = event.result
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.rejected += 1
                time.sleep(0.05)  # back off a little, as a real client would
            else:
                self.errors.append(f"{error.code().name}: {error.details()}")
            return
        if result is None:
            self.errors.append("stream ended without a result")
            return
        self.ttft_ms.append(((first or time.perf_counter()) - started) * 1000)
        self.server_ttft_ms.append(result.ttft_ms)
        self.reuse.append(result.kv_reuse_ratio)
        self.generated_tokens.append(result.generated_tokens)
        if result.tokens_per_sec > 0:
            self.time_per_output_token_ms.append(1000.0 / result.tokens_per_sec)


class BudgetMonitor(threading.Thread):
    """Samples the daemon's Stats: stored bytes against the budget."""

    def __init__(self, daemon_address: str, interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.daemon_address, self.interval_s = daemon_address, interval_s
        self.stop_event = threading.Event()
        self.max_bytes_seen = 0
        self.budget: int | None = None
        self.samples = 0
        self.exceeded = False

    def sample(self, stub) -> None:
        try:
            stats = stub.Stats(cache_pb2.CacheStatsRequest(), timeout=5)
        except grpc.RpcError:
            return
        self.samples += 1
        self.budget = stats.max_bytes
        self.max_bytes_seen = max(self.max_bytes_seen, stats.bytes)
        self.exceeded |= stats.bytes > stats.max_bytes

    def run(self) -> None:
        with grpc.insecure_channel(self.daemon_address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            while not self.stop_event.wait(self.interval_s):
                self.sample(stub)
            self.sample(stub)


def run_load(address: str, clients: int, duration_s: float, max_new_tokens: int = 16,
             daemon_address: str | None = None, daemon_pid: int | None = None, data_dir: Path | None = None,
             request_timeout_s: float = 120.0) -> Report:
    require_loopback(address)
    report = Report(clients=clients, duration_s=duration_s)
    report.daemon_rss_before_bytes = harness.rss_bytes(daemon_pid)
    report.daemon_anon_rss_before_bytes = harness.rss_bytes(daemon_pid, "RssAnon")
    report.lmdb_bytes_before = dir_bytes(data_dir)
    monitor = None
    if daemon_address:
        require_loopback(daemon_address)
        monitor = BudgetMonitor(daemon_address)
        monitor.start()
    started = time.monotonic()
    deadline = started + duration_s
    # Questions never repeat across runs: a later run (another scheduler, in a comparison) against the same
    # daemon would otherwise find the earlier run's questions cached and skip their prefill.
    run_tag = f"{next(_RUN_NUMBERS)}-"
    workers = [Client(address, index, deadline, max_new_tokens, request_timeout_s, run_tag) for index in range(clients)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=duration_s + request_timeout_s + 30)
    elapsed = time.monotonic() - started
    if monitor is not None:
        monitor.stop_event.set()
        monitor.join(timeout=10)
        report.budget_bytes, report.max_stored_bytes_seen = monitor.budget, monitor.max_bytes_seen
        report.budget_samples, report.budget_exceeded = monitor.samples, monitor.exceeded
    ttft = [value for worker in workers for value in worker.ttft_ms]
    server_ttft = [value for worker in workers for value in worker.server_ttft_ms]
    reuse = [value for worker in workers for value in worker.reuse]
    report.requests = len(ttft)
    report.errors = sum(len(worker.errors) for worker in workers) + sum(worker.is_alive() for worker in workers)
    report.error_messages = sorted({message for worker in workers for message in worker.errors})[:10]
    report.rejected = sum(worker.rejected for worker in workers)
    report.ttft_ms_p50, report.ttft_ms_p99 = percentile(ttft, 0.5), percentile(ttft, 0.99)
    report.server_ttft_ms_p50, report.server_ttft_ms_p99 = percentile(server_ttft, 0.5), percentile(server_ttft, 0.99)
    report.mean_kv_reuse_ratio = statistics.fmean(reuse) if reuse else 0.0
    report.requests_per_s = report.requests / elapsed if elapsed else 0.0
    report.output_tokens = sum(sum(worker.generated_tokens) for worker in workers)
    report.output_tokens_per_s = report.output_tokens / elapsed if elapsed else 0.0
    report.time_per_output_token_ms_p50 = percentile(
        [value for worker in workers for value in worker.time_per_output_token_ms], 0.5)
    report.daemon_rss_after_bytes = harness.rss_bytes(daemon_pid)
    report.daemon_anon_rss_after_bytes = harness.rss_bytes(daemon_pid, "RssAnon")
    report.lmdb_bytes_after = dir_bytes(data_dir)
    return report


def format_report(report: Report) -> str:
    def mib(value: int | None) -> str:
        return "n/a" if value is None else f"{value / (1 << 20):.1f} MiB"

    lines = [
        f"load: {report.clients} clients x {report.duration_s:.0f} s: {report.requests} requests "
        f"({report.requests_per_s:.2f}/s), errors {report.errors}, RESOURCE_EXHAUSTED rejections {report.rejected}",
        f"TTFT client p50 {report.ttft_ms_p50:.1f} ms, p99 {report.ttft_ms_p99:.1f} ms; "
        f"server p50 {report.server_ttft_ms_p50:.1f} ms, p99 {report.server_ttft_ms_p99:.1f} ms; "
        f"mean kv_reuse_ratio {report.mean_kv_reuse_ratio:.2f}",
        f"daemon RSS {mib(report.daemon_rss_before_bytes)} -> {mib(report.daemon_rss_after_bytes)} (anonymous "
        f"{mib(report.daemon_anon_rss_before_bytes)} -> {mib(report.daemon_anon_rss_after_bytes)}); "
        f"LMDB dir {mib(report.lmdb_bytes_before)} -> {mib(report.lmdb_bytes_after)}",
        f"budget: max stored {mib(report.max_stored_bytes_seen)} of {mib(report.budget_bytes)} over "
        f"{report.budget_samples} samples: {'EXCEEDED' if report.budget_exceeded else 'respected'}",
    ]
    lines += [f"  error: {message}" for message in report.error_messages]
    return "\n".join(lines)


def start_stack(stack: ExitStack, model: str, chunk_size: int, max_bytes: str, max_queue: int,
                work_dir: Path, *service_args: str) -> tuple[str, str, int, Path]:
    """Daemon and service processes on free loopback ports; stopped when `stack` closes."""
    daemon = harness.start_daemon(stack, work_dir, "--max-bytes", max_bytes)
    service = harness.start_service(stack, harness.model_path(model, work_dir), daemon.address, work_dir,
                                    "--chunk-size", str(chunk_size), "--max-queue", str(max_queue), *service_args)
    return service.address, daemon.address, daemon.process.pid, work_dir / "lmdb"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="a running inference service (loopback); default: start a stack")
    parser.add_argument("--daemon-address", help="its cache daemon, for the budget check")
    parser.add_argument("--daemon-pid", type=int, help="the daemon's pid, for its RSS")
    parser.add_argument("--data-dir", type=Path, help="the daemon's LMDB directory, for its size")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="model of the stack this script starts ('tiny': the random 2-layer test Llama)")
    parser.add_argument("--chunk-size", type=int, default=128, help="of the stack this script starts")
    parser.add_argument("--max-bytes", default="256M", help="daemon budget of the stack this script starts")
    parser.add_argument("--max-queue", type=int, default=64, help="service queue of the stack this script starts")
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients must be >= 1 and --duration > 0")
    with ExitStack() as stack:
        if args.address:
            address, daemon_address, daemon_pid, data_dir = args.address, args.daemon_address, args.daemon_pid, args.data_dir
        else:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-load-")))
            address, daemon_address, daemon_pid, data_dir = start_stack(
                stack, args.model, args.chunk_size, args.max_bytes, args.max_queue, work_dir)
        report = run_load(address, args.clients, args.duration, args.max_new_tokens, daemon_address, daemon_pid,
                          data_dir)
    print(format_report(report), flush=True)
    harness.write_json(args.json, asdict(report))
    return 0 if report.errors == 0 and not report.budget_exceeded else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
