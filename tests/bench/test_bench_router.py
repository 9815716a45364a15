"""bench/bench_router.py: what a measured phase adds up to, and a smoke run on the tiny model."""
from __future__ import annotations

import json

import pytest

from bench.bench_router import PolicyReport, Sample, format_report, main, summarize


def test_a_phase_splits_prompt_tokens_by_tier_and_counts_the_spread():
    samples = [Sample(100.0, prompt_tokens=1000, cached_tokens=896, cacheable_tokens=896),
               Sample(300.0, prompt_tokens=1000, cached_tokens=0, cacheable_tokens=896),
               Sample(200.0, prompt_tokens=1000, cached_tokens=896, cacheable_tokens=896)]
    # One of the two hits came from L2 (7 chunks of 128 promoted).
    report = summarize("prefix", True, samples, errors=0, seconds=2.0, l2_tokens=896, per_replica=[2, 1])
    assert (report.requests, report.requests_per_s, report.ttft_ms_p50, report.ttft_ms_p99) == (3, 1.5, 200.0, 300.0)
    assert (report.share_l1, report.share_l2) == (pytest.approx(896 / 3000), pytest.approx(896 / 3000))
    assert report.share_computed == pytest.approx(1208 / 3000)
    assert report.cacheable_from_l1 == pytest.approx(896 / 2688)
    assert report.spread == 2.0
    assert format_report([report]).splitlines()[2].split(" | ")[:4] == ["| prefix", "True", "3", "1.50"]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_smoke_run_on_the_tiny_model_reports_every_policy(tmp_path):
    out = tmp_path / "router.json"
    status = main(["--model", "tiny", "--replicas", "2", "--documents", "3", "--sheets", "2", "--clients", "2",
                   "--warmup", "0.5", "--duration", "2", "--chunk-size", "32", "--json", str(out)])
    reports = [PolicyReport(**row) for row in json.loads(out.read_text())]
    assert status == 0 and [report.policy for report in reports] == ["round-robin", "least-loaded", "prefix"]
    assert all(report.requests > 0 and sum(report.per_replica) >= report.requests for report in reports)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_smoke_run_of_the_overhead_measure(capsys):
    assert main(["--model", "tiny", "--documents", "1", "--sheets", "1", "--chunk-size", "32", "--overhead", "2"]) == 0
    assert "through the router" in capsys.readouterr().out
