"""The schema-driven fuzzers' long run against a real stack (daemon, service, gateway with an API key): Schemathesis
from the gateway's OpenAPI document while an ordinary greedy request runs beside it, then messages generated from the
proto descriptors to every RPC (docs/benchmarks.md#schema-driven-fuzzing-http-and-grpc). Exit status 0 only when no
response is >= 500, no check failed, no gRPC reply is outside OK and clients' errors and the ordinary answer held.

    flock /tmp/kvboost-bench.lock python bench/bench_gateway_fuzz.py                       # 10,000 + 10,000
    python bench/bench_gateway_fuzz.py --model tiny --requests 300 --messages 200          # a quick look
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10000,
                        help="HTTP requests Schemathesis sends at least (0: no HTTP fuzzing)")
    parser.add_argument("--messages", type=int, default=10000,
                        help="generated gRPC messages sent at least, spread over every RPC (0: no gRPC fuzzing)")
    parser.add_argument("--max-examples", type=int, default=300,
                        help="Schemathesis's examples per operation, phase and mode in one run (runs repeat with "
                             "seed+1, seed+2... until --requests)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="the service's model; 'tiny': the random 2-layer test Llama")
    parser.add_argument("--seed", type=int, default=20261126, help="seed of the first run of each fuzzer")
    parser.add_argument("--max-new-tokens", type=int, default=16,
                        help="the service's --max-new-tokens (keeps each valid request short)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the stack's files go (default: a temp dir)")
    return parser.parse_args(argv)


def fuzz_http(gateway_url: str, args: argparse.Namespace):
    from tests.e2e import schema_fuzz
    from tests.e2e.test_gateway_fuzz import API_KEY, Beside

    report, run_index = schema_fuzz.FuzzReport(), 0
    with Beside(gateway_url) as beside:
        while report.num_requests < args.requests:
            schema = schema_fuzz.load_schema(gateway_url, API_KEY, args.max_examples, seed=args.seed + run_index)
            report.add(schema_fuzz.run(schema))
            run_index += 1
            print(f"  run {run_index}: {report.num_requests} requests so far", flush=True)
    return report, beside.answers, run_index


def fuzz_grpc(daemon_address: str, service_address: str, args: argparse.Namespace):
    import grpc

    from kvboost.v1 import cache_pb2, inference_pb2
    from tests.e2e.grpc_fuzz import RpcReport, fuzz_service

    services = [(daemon_address, cache_pb2.DESCRIPTOR.services_by_name["CacheService"], {"WatchEvents"}),
                (service_address, inference_pb2.DESCRIPTOR.services_by_name["InferenceService"], set())]
    per_rpc = math.ceil(args.messages / sum(len(service.methods) for _, service, _ in services))
    report = RpcReport()
    for address, service, endless in services:
        with grpc.insecure_channel(address) as channel:
            report.add(fuzz_service(channel, service, per_rpc, args.seed, endless=frozenset(endless),
                                    stop_at_failure=False))
        print(f"  {service.name}: {report.num_messages} messages so far", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import httpx

    from tests.conftest import pick_free_port
    from tests.e2e.gateway_process import running_gateways
    from tests.e2e.service_process import running_service
    from tests.e2e.test_gateway_fuzz import API_KEY, ordinary_answer

    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="kvboost-fuzz-"))
    model = harness.model_path(args.model, work_dir)
    key_file = work_dir / "api.key"
    key_file.write_text(API_KEY + "\n")
    with ExitStack() as stack:
        daemon = harness.start_daemon(stack, work_dir)
        service = stack.enter_context(running_service(model, daemon.address, pick_free_port(),
                                                      work_dir / "service.log", "--max-new-tokens",
                                                      str(args.max_new_tokens), timeout_s=300))
        (gateway,) = stack.enter_context(running_gateways((service.address, pick_free_port(), work_dir / "gateway.log",
                                                           "--api-key-file", str(key_file), "--default-max-tokens",
                                                           "4")))
        pids = {"daemon": daemon.process.pid, "service": service.process.pid, "gateway": gateway.process.pid}
        rss_before = {name: harness.rss_bytes(pid) / 2**20 for name, pid in pids.items()}
        client = stack.enter_context(httpx.Client(base_url=gateway.base_url, timeout=300,
                                                  headers={"Authorization": f"Bearer {API_KEY}"}))
        before = ordinary_answer(client)
        started = time.perf_counter()
        http, beside, runs = fuzz_http(gateway.base_url, args) if args.requests > 0 else (None, [], 0)
        http_s = time.perf_counter() - started
        grpc_report = fuzz_grpc(daemon.address, service.address, args) if args.messages > 0 else None
        grpc_s = time.perf_counter() - started - http_s
        after = ordinary_answer(client)
        alive = all(process.process.poll() is None for process in (daemon, service, gateway))
        rss_after = {name: harness.rss_bytes(pid) / 2**20 for name, pid in pids.items()}

    print(f"\n{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, model {args.model}, seed {args.seed}")
    ok = before == after and all(answer == before for answer in beside) and alive
    if http is not None:
        print(f"HTTP (Schemathesis, {runs} runs, {http_s:.0f} s): {http.num_requests} requests; by class "
              f"{http.by_class()}; by status {dict(sorted(http.statuses.items()))}; by phase {dict(http.phases)}")
        print(f"  responses >= 500: {len(http.server_errors)}; failed checks: {len(http.failures)}; "
              f"engine errors: {len(http.errors)}")
        for line in (http.server_errors + http.failures + http.errors)[:5]:
            print("   ", line[:400])
        ok = ok and not http.server_errors and not http.failures and not http.errors
    if grpc_report is not None:
        print(f"gRPC (from the descriptors, {grpc_s:.0f} s): {grpc_report.num_messages} messages; by status "
              f"{grpc_report.by_status()}; outside OK and clients' errors: {len(grpc_report.failures)}")
        for line in grpc_report.failures[:5]:
            print("   ", line[:400])
        ok = ok and not grpc_report.failures
    print(f"ordinary greedy request before, beside ({len(beside)} times) and after: "
          f"{'same' if before == after and all(answer == before for answer in beside) else 'DIFFERENT'} ({before!r}); "
          f"all processes up: {alive}")
    print("RSS MiB before -> after: " + ", ".join(f"{name} {rss_before[name]:.0f} -> {rss_after[name]:.0f}"
                                                  for name in pids))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
