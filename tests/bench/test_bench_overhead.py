"""bench/bench_overhead.py end to end on its negligible model: every part prints a row with figures, the in-process
rows split the host's work into stages, and the served rows come from a real kvboost_server."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # SmolLM2's real tokenizer and template


def test_a_short_run_prints_every_part_with_its_stages(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_overhead.py"), "--parts", "in-process", "http", "grpc",
         "--lengths", "2048", "--cold-lengths", "2048", "--rounds", "1", "--model-dir", str(tmp_path / "model"),
         "--work-dir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    number = r"([\d.]+)"
    rows = re.findall(rf"\| (in-process|http|grpc) \| now \| (L0 auto|L0 off|cold) \| (\d+) \| (\d*) \| {number} \|"
                      r"(.*)\|", result.stdout)
    assert {(part, source) for part, source, *_ in rows} == {
        ("in-process", "L0 auto"), ("in-process", "L0 off"), ("in-process", "cold"), ("http", "L0 auto"),
        ("grpc", "L0 auto")}, result.stdout
    for part, source, tokens, cached, ttft, stages in rows:
        assert int(tokens) >= 2000 and float(ttft) > 0
        if part == "in-process" and source != "cold":
            assert int(cached) >= 2000  # asked before: every whole chunk reused
            tokenize, keys, lookup, placement, host, rest = (float(v) for v in stages.split("|")[:6])
            assert host == pytest.approx(tokenize + keys + lookup + placement, abs=0.02)
