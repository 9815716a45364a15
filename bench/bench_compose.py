"""The compose stack on a real Docker engine: cold start to all healthy, TTFT inside the stack, reuse after down/up.

Images are built first (tests/deploy/docker_images.py: stand-in base image, local torch index); then a fresh
project (its own name, free loopback ports, a new LMDB volume) is timed from `docker compose up` to every
health check passing. A ~1.6k-token document (not a whole number of 128-token chunks) is warmed through the
published gRPC port; runs alternate BASELINE and PREFIX_CACHE, each with a new question, and the medians of
the service's TTFT are compared (target >= 15x, with Stats.read_mode "locked_map"). Then `down`, `up`, and
the first request's reuse (target >= 0.9). Everything started is stopped; `down -v` at the end.

    flock /tmp/kvboost-bench.lock python bench/bench_compose.py [--runs 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

import grpc  # noqa: E402

from kvboost.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402
from kvboost.v1 import inference_pb2 as pb  # noqa: E402
from kvboost.v1 import inference_pb2_grpc  # noqa: E402

TARGET_TOKENS = 1600
CHUNK_SIZE = 128
SPEEDUP_TARGET = 15.0
REUSE_TARGET = 0.9
HEALTHY_TARGET_S = 60.0
PASSAGE = ("Section {n}. The harbour office keeps the ferry timetable. Boat {n} leaves pier {pier} at {hour}:{minute:02d}, "
           "calls at the lighthouse, and returns before the tide turns; tickets are sold on board.\n")


@dataclass(slots=True, frozen=True)
class Summary:
    engine: str
    compose: str
    healthy_s: float
    prompt_tokens: int
    document_tokens: int
    baseline_ms: float  # median TTFT
    cached_ms: float
    read_mode: str
    fetch_bytes: int  # blob bytes the daemon served over Fetch during the runs: 0 when all came from the map
    reuse_after_restart: float
    runs: int

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.cached_ms


def build_document(count_tokens: Callable[[str], int], target: int = TARGET_TOKENS) -> str:
    """Passages until at least `target` tokens, with one more while the count is a whole number of chunks."""
    passages: list[str] = []
    num_tokens = 0
    while num_tokens < target or num_tokens % CHUNK_SIZE == 0:
        n = len(passages)
        passages.append(PASSAGE.format(n=n, pier=n % 7, hour=6 + n % 14, minute=(n * 13) % 60))
        num_tokens = count_tokens("".join(passages))
    return "".join(passages)


def format_summary(summary: Summary) -> list[str]:
    met = lambda ok: "met" if ok else "missed"  # noqa: E731
    return [
        f"Docker Engine {summary.engine}, Compose {summary.compose}",
        f"cold start to all healthy: {summary.healthy_s:.1f} s (target <= {HEALTHY_TARGET_S:.0f} s: "
        f"{met(summary.healthy_s <= HEALTHY_TARGET_S)})",
        f"document {summary.document_tokens} tokens ({summary.document_tokens // CHUNK_SIZE} chunks + "
        f"{summary.document_tokens % CHUNK_SIZE}), prompt {summary.prompt_tokens} tokens; {summary.runs} runs each, alternating",
        f"TTFT p50: BASELINE {summary.baseline_ms:.0f} ms, PREFIX_CACHE {summary.cached_ms:.1f} ms: "
        f"{summary.speedup:.1f}x (target >= {SPEEDUP_TARGET:.0f}x: {met(summary.speedup >= SPEEDUP_TARGET)}); "
        f"read mode {summary.read_mode}, {summary.fetch_bytes} blob bytes over Fetch",
        f"reuse on the first request after down/up: {summary.reuse_after_restart:.3f} "
        f"(target >= {REUSE_TARGET}: {met(summary.reuse_after_restart >= REUSE_TARGET)})",
    ]


def question(n: int) -> str:
    return f" Question {n}: at what time does boat {n % 9} leave, and from which pier? Answer:"


def ttft_ms(stub, prompt: str, mode: int) -> pb.GenerationResult:
    events = list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=4, mode=mode), timeout=600))
    return events[-1].result


def measure(runs: int) -> Summary:
    from tests.deploy.compose_project import ComposeProject
    from tests.deploy.docker_engine import start_engine
    from tests.deploy.docker_images import prepare_images

    engine = start_engine()
    try:
        prepare_images()
        project = ComposeProject(f"kvboost-bench-{os.getpid()}")
        try:
            healthy_s = project.up()
            stub = inference_pb2_grpc.InferenceServiceStub(project.channel("INFERENCE"))
            count = lambda text: len(stub.Tokenize(pb.TokenizeRequest(prompt=text), timeout=60).token_ids)  # noqa: E731
            document = build_document(count)
            warmed = stub.Warm(pb.WarmRequest(text=document), timeout=600)
            baseline, cached = [], []
            for n in range(runs):
                baseline.append(ttft_ms(stub, document + question(2 * n), pb.BASELINE))
                cached.append(ttft_ms(stub, document + question(2 * n + 1), pb.PREFIX_CACHE))
            read_mode = stub.Stats(pb.ServiceStatsRequest(), timeout=10).read_mode
            fetch_bytes = daemon_bytes_read(project.channel("DAEMON"))
            project.down()
            project.up()
            stub = inference_pb2_grpc.InferenceServiceStub(project.channel("INFERENCE"))
            after = ttft_ms(stub, document + question(10_000), pb.PREFIX_CACHE)
        finally:
            project.down(volumes=True)
    finally:
        engine.stop()
    return Summary(engine.engine_version, engine.compose_version, healthy_s, cached[0].prompt_tokens,
                   warmed.token_count, statistics.median(r.ttft_ms for r in baseline),
                   statistics.median(r.ttft_ms for r in cached), read_mode or "(not reported)", fetch_bytes,
                   after.kv_reuse_ratio, runs)


def daemon_bytes_read(channel: grpc.Channel) -> int:
    with channel:
        return cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.CacheStatsRequest(), timeout=10).bytes_read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="BASELINE/PREFIX_CACHE pairs (default 5)")
    args = parser.parse_args()
    for line in format_summary(measure(args.runs)):
        print(line)


if __name__ == "__main__":
    main()
