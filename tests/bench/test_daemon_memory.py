"""bench/daemon_memory.py: its plateau/growth verdict, and one short run against a real daemon."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.daemon_memory import linear_fit, parse_args, print_verdict

ROOT = Path(__file__).resolve().parents[2]
CALLS = [250 * number for number in range(1, 13)]


def test_linear_fit_gives_slope_per_1000_calls_and_residual_noise() -> None:
    slope, noise = linear_fit([1000, 2000, 3000], [10.0, 12.0, 14.0])
    assert (round(slope, 6), round(noise, 6)) == (2.0, 0.0)
    slope, noise = linear_fit([1000, 2000, 3000, 4000], [10.0, 12.0, 10.0, 12.0])
    assert round(slope, 6) == 0.4 and noise > 0.8


@pytest.mark.parametrize("anon, verdict", [
    ([100.0 + 2 * number for number in range(12)], "verdict: growth"),  # +8 MiB per 1000 calls, no noise
    # The baseline run of 2026-11-23 11:39: bounded, bouncing by +-8 MiB around ~190 MiB.
    ([149.6, 196.4, 197.5, 182.1, 159.1, 171.4, 184.8, 191.8, 205.4, 201.7, 182.1, 196.5], "verdict: plateau"),
    ([150.0] * 12, "verdict: plateau"),
])
def test_verdict(anon, verdict, capsys) -> None:
    print_verdict(parse_args([]), CALLS, anon, 50.0)
    assert capsys.readouterr().out.startswith(verdict)


def test_too_few_rounds_give_no_verdict(capsys) -> None:
    print_verdict(parse_args([]), CALLS[:4], [100.0, 110.0, 120.0, 130.0], 50.0)
    assert capsys.readouterr().out.startswith("verdict: none")


@pytest.mark.e2e
def test_a_short_run_prints_one_line_per_round_and_a_verdict() -> None:
    completed = subprocess.run(
        [sys.executable, "bench/daemon_memory.py", "--chunks", "2", "--chunk-bytes", "1M", "--store-bytes", "4K",
         "--threads", "2", "--calls", "12", "--round", "2", "--settle", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    lines = completed.stdout.splitlines()
    rounds = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rounds] == [0, 2, 4, 6, 8, 10, 12], completed.stdout
    assert float(rounds[-1][3]) == pytest.approx(12 * 2 * 2**20 / 1e9, abs=0.01)  # GB fetched
    assert lines[-1].startswith(("verdict: plateau", "verdict: growth")), completed.stdout
