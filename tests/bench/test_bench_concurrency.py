"""bench/bench_concurrency.py on the tiny model: every scheduler's row, the ratios, and each service's decode step
as it ran (a step that cannot run here is not credited with the batched row it did not produce)."""
from __future__ import annotations

import json
import re

import pytest

from bench import bench_concurrency

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_step_run_reads_the_services_choice_from_its_log() -> None:
    log = ("decode step split is off for this model (torch's inter-op pool has one thread); trying lean\n"
           "decode step: lean (bitwise the model's forward)\n")
    assert bench_concurrency.step_run(log) == "lean"
    assert bench_concurrency.step_run("decode step lean is off for this model, each step runs transformers' "
                                      "forward: not a Llama") == "transformers"
    assert bench_concurrency.step_run("nothing said") == "unknown"


def test_a_short_run_prints_each_row_and_the_ratio_with_the_step_that_ran(tmp_path, capsys) -> None:
    assert bench_concurrency.main(["--model", "tiny", "--levels", "2", "--duration", "1", "--max-new-tokens", "4",
                                   "--chunk-size", "16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"decode step run by each service \{'one-at-a-time': '\w+', 'batched': 'lean'\}", out), out
    for scheduler in ("one-at-a-time", "batched"):
        assert re.search(rf"^{scheduler} +2 clients: .* errors 0, rejected 0, budget respected$", out, re.M), out
    assert re.search(r"^  2 clients: batched / one-at-a-time output tok/s = [\d.]+x$", out, re.M), out
    rows = json.loads((tmp_path / "concurrency.json").read_text())
    assert {row["scheduler"]: row["decode_step_run"] for row in rows}["batched"] == "lean"
