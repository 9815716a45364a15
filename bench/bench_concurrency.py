"""One request at a time against the running batch under concurrent clients, in one run, on the shared system-prompt
workload (bench/load.py's), optionally beside the service of an earlier commit (--baseline-tree).

One daemon and a service per configuration: `one-at-a-time` (--max-running-requests 1), `batched` (the defaults),
`before` (that tree's); at each level every service gets the same load in turn. Per row: requests/s, output tokens/s,
p50/p99 TTFT, p50 time per output token, errors, the daemon's budget and RSS; a plot of throughput and p99 TTFT.

    flock /tmp/kvboost-bench.lock python bench/bench_concurrency.py --baseline-tree /tmp/before   # git worktree add
    flock /tmp/kvboost-bench.lock python bench/bench_concurrency.py --model tiny --levels 1 4 --duration 5
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from bench.load import SYSTEM_PROMPT, Report, run_load  # noqa: E402

# label -> the service's own flags (besides model, daemon, port, chunk size and queue).
CONFIGS = {"one-at-a-time": ("--max-running-requests", "1"), "batched": ()}
BEFORE = "before"  # the service of --baseline-tree
# The daemon's resident memory, split: its heap (what would leak) and the LMDB file pages it has mapped in
# (they grow with the pages read and written, and are the kernel's to drop under memory pressure).
RSS_FIELDS = {"VmRSS": "all", "RssAnon": "anonymous", "RssFile": "mapped LMDB file pages"}


def start_services(stack: ExitStack, model: str, chunk_size: int, max_bytes: str, max_queue: int,
                   work_dir: Path, baseline_tree: Path | None = None) -> tuple[dict[str, str], str, int, dict[str, str]]:
    """The daemon and one service per configuration; ({label: address}, daemon address, daemon pid, {label: the
    decode step the service runs, from its log}): a step that cannot run here falls back (lean to
    transformers), and a row must not be credited to a step that did not run."""
    model = harness.model_path(model, work_dir)
    daemon = harness.start_daemon(stack, work_dir, "--max-bytes", max_bytes)
    configs = {label: (flags, None) for label, flags in CONFIGS.items()}
    if baseline_tree is not None:
        configs = {BEFORE: ((), baseline_tree), **configs}
    addresses, steps_run = {}, {}
    for label, (flags, tree) in configs.items():
        service = harness.start_service(stack, model, daemon.address, work_dir, "--chunk-size", str(chunk_size),
                                        "--max-queue", str(max_queue), *flags, name=f"service-{label}", tree=tree)
        addresses[label] = service.address
        steps_run[label] = step_run(service.log())
    return addresses, daemon.address, daemon.process.pid, steps_run


def step_run(log: str) -> str:
    """The decode step a service's start-up log says it runs (model/step_runner.py logs its choice)."""
    if "each step runs transformers' forward" in log:
        return "transformers"
    found = re.findall(r"decode step: (\w+)", log)
    return found[-1] if found else "unknown"


def warm_system_prompt(address: str) -> None:
    import grpc
    from kvboost.v1 import inference_pb2 as pb
    from kvboost.v1 import inference_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        result = inference_pb2_grpc.InferenceServiceStub(channel).Warm(pb.WarmRequest(text=SYSTEM_PROMPT), timeout=300)
    print(f"warmed the system prompt: {result.token_count} tokens, {result.chunks_stored} chunks stored", flush=True)


def format_row(scheduler: str, report: Report) -> str:
    return (f"{scheduler:<13} {report.clients:>3} clients: {report.requests_per_s:6.2f} req/s, "
            f"{report.output_tokens_per_s:7.1f} out tok/s, TTFT p50 {report.ttft_ms_p50:8.1f} ms "
            f"p99 {report.ttft_ms_p99:8.1f} ms, TPOT p50 {report.time_per_output_token_ms_p50:6.1f} ms, "
            f"errors {report.errors}, rejected {report.rejected}, "
            f"budget {'EXCEEDED' if report.budget_exceeded else 'respected'}")


def write_plot(rows: list[dict], path: Path) -> None:
    plt = harness.pyplot()
    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(10, 4.2))
    for scheduler in dict.fromkeys(row["scheduler"] for row in rows):
        points = [row for row in rows if row["scheduler"] == scheduler]
        levels = [row["clients"] for row in points]
        throughput.plot(levels, [row["output_tokens_per_s"] for row in points], marker="o", label=scheduler)
        ttft.plot(levels, [row["ttft_ms_p99"] / 1000 for row in points], marker="o", label=scheduler)
    throughput.set_xlabel("concurrent clients")
    throughput.set_ylabel("output tokens/s")
    ttft.set_xlabel("concurrent clients")
    ttft.set_ylabel("p99 TTFT (s)")
    ttft.set_yscale("log")
    for axis in (throughput, ttft):
        axis.legend(fontsize=8)
    figure.suptitle("SmolLM2-135M, CPU fp32, shared system prompt: one at a time vs the running batch")
    figure.tight_layout()
    figure.savefig(path)


def ratio(row: dict, baseline: str, field: str = "output_tokens_per_s") -> float:
    return row["batched"][field] / row[baseline][field] if row[baseline][field] else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="'tiny': the random 2-layer test Llama")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16], help="concurrent clients")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per level and scheduler")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--max-bytes", default="256M", help="daemon budget")
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads of each service (OMP_NUM_THREADS); 1 keeps a shared 2-core machine "
                             "from stalling batched matmuls on busy cores")
    parser.add_argument("--baseline-tree", type=Path,
                        help="a checkout of an earlier commit (git worktree add DIR COMMIT): its service runs as "
                             "`before` beside this one, in the same run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for concurrency.png and .json")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the services inherit it; torch sizes its pool by it
    rows, failed = [], False
    with ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-concurrency-")))
        addresses, daemon_address, daemon_pid, steps_run = start_services(
            stack, args.model, args.chunk_size, args.max_bytes, args.max_queue, work_dir, args.baseline_tree)
        warm_system_prompt(addresses["batched"])  # as a deployment would: its partial last chunk included
        for scheduler in addresses:  # each service's first forward
            run_load(addresses[scheduler], 1, 0.1, args.max_new_tokens)
        rss_start = {field: harness.rss_bytes(daemon_pid, field) for field in RSS_FIELDS}
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {args.model}, {args.duration:.0f} s per row, "
              f"max_new_tokens {args.max_new_tokens}, {args.threads} torch thread(s) per service, system prompt "
              f"warmed; decode step run by each service {steps_run}", flush=True)
        for clients in args.levels:
            for scheduler in addresses:
                report = run_load(addresses[scheduler], clients, args.duration, args.max_new_tokens,
                                  daemon_address, daemon_pid)
                print(format_row(scheduler, report), flush=True)
                rows.append({"scheduler": scheduler, "decode_step_run": steps_run[scheduler], **asdict(report)})
                failed |= report.errors > 0 or report.budget_exceeded
        rss_end = {field: harness.rss_bytes(daemon_pid, field) for field in RSS_FIELDS}
    for clients in args.levels:
        row = {r["scheduler"]: r for r in rows if r["clients"] == clients}
        line = f"{clients:>3} clients: batched / one-at-a-time output tok/s = {ratio(row, 'one-at-a-time'):.2f}x"
        if BEFORE in row:
            line += (f"; batched / before: output tok/s {ratio(row, BEFORE):.2f}x, TTFT p50 "
                     f"{row['batched']['ttft_ms_p50']:.1f} vs {row[BEFORE]['ttft_ms_p50']:.1f} ms")
        print(line)
    mib = (lambda value: "n/a" if value is None else f"{value / (1 << 20):.1f} MiB")
    print("daemon RSS " + ", ".join(f"{RSS_FIELDS[field]} {mib(rss_start[field])} -> {mib(rss_end[field])}"
                                    for field in RSS_FIELDS))
    harness.write_json(args.out / "concurrency.json", rows)
    write_plot(rows, args.out / "concurrency.png")
    print(f"wrote {args.out / 'concurrency.png'} and concurrency.json")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
