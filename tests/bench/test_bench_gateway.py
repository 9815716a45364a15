"""bench/bench_gateway.py without a model: the summary it prints and how it judges the targets."""
from __future__ import annotations

from bench.bench_gateway import Summary, build_context, format_summary, rate


def summary(**overrides) -> Summary:
    values = dict(ttft_grpc_ms=100.0, ttft_http_ms=103.0, ttft_paired_delta_ms=2.5, server_ttft_ms=98.0,
                  rate_grpc=40.0, rate_http=39.0, prompt_tokens=1562, cached_tokens=1536, runs=20, stream_runs=6)
    return Summary(**{**values, **overrides})


def test_the_summary_prints_both_paths_and_both_targets():
    assert format_summary(summary()) == [
        "prompt 1562 tokens, 1536 cached; 20 TTFT pairs, 6 streaming pairs",
        "path      TTFT p50 ms  stream tok/s p50",
        "gRPC            100.0              40.0",
        "HTTP            103.0              39.0",
        "HTTP - gRPC TTFT: +3.0 ms at p50 (paired median +2.5 ms; target <= +5 ms: met); service-side TTFT p50 98.0 ms",
        "HTTP / gRPC streaming rate: 0.975 (target within 5%: met)",
    ]


def test_targets_are_missed_past_5_ms_and_past_5_percent():
    missed = summary(ttft_http_ms=105.5, rate_http=37.9)
    assert not missed.ttft_met and not missed.rate_met
    assert "missed" in format_summary(missed)[4] and "missed" in format_summary(missed)[5]


def test_rate_counts_the_tokens_between_the_first_and_last_pieces():
    assert rate([10.0, 10.5, 12.0], num_tokens=5) == 2.0


def test_context_has_exactly_the_tokens_asked_for():
    count = len  # one token per character
    assert len(build_context(count, 700)) == 700
