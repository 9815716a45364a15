"""bench/bench_fast_step.py on the tiny model: every decode step timed per case, and the identity sweep."""
from __future__ import annotations

import re

import pytest

from bench import bench_fast_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_it_times_every_step_per_case_and_sweeps_identity_against_generate(capsys) -> None:
    assert bench_fast_step.main(["--model", "tiny", "--cases", "1x20", "2x30", "--rounds", "1", "--steps-per-round", "2",
                                 "--steps", "transformers", "lean", "--sweep", "4", "--sweep-tokens", "6",
                                 "--sweep-wave", "2"]) == 0
    out = capsys.readouterr().out
    timed = re.findall(r"(\d+) row\(s\) x ~(\d+) tokens, float32 (\w+) *: +[\d.]+ ms per step, +[\d.]+ tokens/s, "
                       r"[\d.]+x float32 transformers", out)
    assert timed == [("1", "20", "transformers"), ("1", "20", "lean"), ("2", "30", "transformers"), ("2", "30", "lean")]
    assert "'float32 lean': 'lean'" in out  # the engine ran the step asked for, not a fallback
    sweep = re.findall(r"(\w+) *: (\d+)/4 prompts token-identical, ([\d.]+)% of tokens in place, none diverges", out)
    assert sweep == [("transformers", "4", "100.00"), ("lean", "4", "100.00")]


def test_sweep_cases_share_system_prompts_and_agreement_counts_divergence() -> None:
    cases = bench_fast_step.sweep_cases(200)
    assert len(set(cases)) == 200 and len({case[0] for case in cases}) == len(bench_fast_step.SYSTEMS)
    # Two prompts: one identical, one diverging at its third token (of 4): 1 identical, 6/8 tokens in place.
    assert bench_fast_step.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 9, 9]]) == (1, 0.75, 2)


@pytest.mark.slow  # an inductor compilation: 10-30 s of C++ builds on a 2-core machine
def test_it_compares_torch_compile_of_the_lean_step_with_it_eager(capsys) -> None:
    assert bench_fast_step.main(["--model", "tiny", "--cases", "1x20", "--skip-timing", "--compile",
                                 "--steps-per-round", "2"]) == 0
    assert re.search(r"torch.compile of the lean step \(inductor, static shapes, 1 row over \d+ columns\): first call "
                     r"[\d.]+ s; step [\d.]+ ms vs [\d.]+ ms eager \([\d.]+x\); logits (bitwise equal|differ by up to )",
                     capsys.readouterr().out)


def test_a_baseline_tree_alternates_with_this_one_and_prints_the_ratio(tmp_path, capsys) -> None:
    # this tree as its own baseline: both trees' runs are timed, alternating, and compared case by case
    assert bench_fast_step.main(["--model", "tiny", "--cases", "1x20", "--rounds", "1", "--steps-per-round", "2",
                                 "--threads", "1", "--baseline-tree", str(bench_fast_step.ROOT), "--pairs", "2"]) == 0
    out = capsys.readouterr().out
    order = re.findall(r"^  run (\d) (this|before) *: 1x20 float32 lean [\d.]+ ms$", out, re.M)
    assert order == [("1", "before"), ("1", "this"), ("2", "this"), ("2", "before")], out
    assert re.search(r"^1x20 float32 lean: this tree [\d.]+ ms per step, before [\d.]+ ms: [\d.]+x \(this tree "
                     r"(faster|slower) by [\d.]+%\)$", out, re.M), out


def test_timed_lines_read_every_case_and_step() -> None:
    out = ("   1 row(s) x ~50 tokens, float32 lean              :    24.3 ms per step,   41.1 tokens/s, 1.00x x\n"
           "  16 row(s) x ~700 tokens, float32 transformers     :    95.0 ms per step,  168.4 tokens/s, 0.91x x\n")
    assert bench_fast_step.timed_lines(out) == {"1x50 float32 lean": 24.3, "16x700 float32 transformers": 95.0}
