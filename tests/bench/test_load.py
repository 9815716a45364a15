"""bench/load.py without a model: what it prints, loopback only, and rejections counted apart from errors."""
from __future__ import annotations

import itertools
import threading

import grpc
import pytest

from bench.load import Report, format_report, require_loopback, run_load
from kvboost.v1 import inference_pb2
from tests.client_fakes import FakeInference, make_result, running_server


def test_the_report_prints_ttft_percentiles_errors_rejections_rss_and_lmdb_size_before_and_after() -> None:
    report = Report(clients=16, duration_s=60, requests=480, errors=0, rejected=7, ttft_ms_p50=120.0,
                    ttft_ms_p99=900.5, server_ttft_ms_p50=100.0, server_ttft_ms_p99=850.0, mean_kv_reuse_ratio=0.9,
                    requests_per_s=8.0, daemon_rss_before_bytes=100 << 20, daemon_rss_after_bytes=120 << 20,
                    daemon_anon_rss_before_bytes=60 << 20, daemon_anon_rss_after_bytes=61 << 20,
                    lmdb_bytes_before=1 << 20, lmdb_bytes_after=3 << 20, budget_bytes=256 << 20,
                    max_stored_bytes_seen=2 << 20, budget_samples=240)
    assert format_report(report).splitlines() == [
        "load: 16 clients x 60 s: 480 requests (8.00/s), errors 0, RESOURCE_EXHAUSTED rejections 7",
        "TTFT client p50 120.0 ms, p99 900.5 ms; server p50 100.0 ms, p99 850.0 ms; mean kv_reuse_ratio 0.90",
        "daemon RSS 100.0 MiB -> 120.0 MiB (anonymous 60.0 MiB -> 61.0 MiB); LMDB dir 1.0 MiB -> 3.0 MiB",
        "budget: max stored 2.0 MiB of 256.0 MiB over 240 samples: respected",
    ]


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "127.0.0.9:1", "localhost:50051", "[::1]:50051"])
def test_loopback_addresses_are_accepted(address) -> None:
    require_loopback(address)


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "10.0.0.5:50051", "[::]:50051", "example.org:50051"])
def test_other_addresses_are_refused(address) -> None:
    with pytest.raises(SystemExit, match="loopback only"):
        require_loopback(address)


class Cycling(FakeInference):
    """Every third call is rejected (RESOURCE_EXHAUSTED), every third fails (INTERNAL), the rest succeed."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: list[str] = []
        self._lock = threading.Lock()
        self._counter = itertools.count()

    def Generate(self, request, context):
        with self._lock:
            outcome = ("ok", "rejected", "error")[next(self._counter) % 3]
            self.outcomes.append(outcome)
        if outcome == "rejected":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (8 waiting)")
        if outcome == "error":
            context.abort(grpc.StatusCode.INTERNAL, "boom")
        yield inference_pb2.GenerateEvent(text="Hi", token_ids=[11])
        yield inference_pb2.GenerateEvent(result=make_result(ttft_ms=5.0))


def test_rejections_are_counted_apart_from_errors() -> None:
    fake = Cycling()
    with running_server(inference=fake) as address:
        report = run_load(address, clients=2, duration_s=0.5, max_new_tokens=2)
    # Each call ends one way; the report counts each way exactly.
    assert report.requests == fake.outcomes.count("ok") > 0
    assert report.rejected == fake.outcomes.count("rejected") > 0
    assert report.errors == fake.outcomes.count("error") > 0
    assert report.error_messages == ["INTERNAL: boom"]
    assert report.server_ttft_ms_p50 == 5.0 and report.ttft_ms_p99 >= report.ttft_ms_p50 > 0
