"""The benchmarks' harness: alternation order, medians, the table, a worker under another tree."""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from bench import harness


def test_alternate_reverses_the_order_every_other_round():
    calls: list[str] = []
    samples = harness.alternate({"before": lambda: calls.append("b") or len(calls),
                                 "now": lambda: calls.append("n") or len(calls)}, rounds=3)
    # round 0: before, now; round 1: now, before; round 2: before, now
    assert calls == ["b", "n", "n", "b", "b", "n"]
    assert samples == {"before": [1, 4, 5], "now": [2, 3, 6]}


def test_alternate_refuses_no_rounds():
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        harness.alternate({"now": lambda: 1}, rounds=0)


def test_summarize_takes_medians_of_numbers_and_keeps_the_rest():
    samples = [{"ttft_ms": 3.0, "tokens": 10, "path": "L0", "ok": True},
               {"ttft_ms": 1.0, "tokens": 10, "path": "L0", "ok": False},
               {"ttft_ms": 2.0, "tokens": 12, "path": "L0", "ok": True}]
    assert harness.summarize(samples, tree="now") == {"tree": "now", "ttft_ms": 2.0, "tokens": 10, "path": "L0",
                                                      "ok": True}


def test_percentile_is_nearest_rank():
    assert harness.percentile([5, 1, 4, 2, 3], 0.0) == 1
    assert harness.percentile([5, 1, 4, 2, 3], 0.5) == 3
    assert harness.percentile([5, 1, 4, 2, 3], 1.0) == 5


def test_table_is_markdown_with_formatted_numbers():
    rows = [{"path": "L0", "ttft_ms": 12.345, "tokens": 2048}, {"path": "daemon", "ttft_ms": 1234.5}]
    assert harness.table(rows, ["path", ("ttft_ms", "TTFT ms"), "tokens"]).splitlines() == [
        "| path | TTFT ms | tokens |", "|---|---|---|", "| L0 | 12.35 | 2048 |", "| daemon | 1,234.50 |  |"]


def test_print_ratios_pairs_each_now_row_with_its_before(capsys):
    rows = [{"tree": "before", "length": 2048, "ttft_ms": 10.0}, {"tree": "now", "length": 2048, "ttft_ms": 5.0},
            {"tree": "now", "length": 8192, "ttft_ms": 7.0}]
    harness.print_ratios(rows, "ttft_ms", ["length"])
    assert capsys.readouterr().out == "  2048 ttft_ms: 10.00 -> 5.00 (2.00x)\n"


def test_trees_refuses_a_folder_that_is_not_a_checkout(tmp_path):
    assert harness.trees(None) == {"now": harness.ROOT}
    with pytest.raises(SystemExit, match="not a checkout"):
        harness.trees(tmp_path)


def test_tree_worker_runs_a_script_under_the_given_tree(tmp_path):
    script = tmp_path / "echo_worker.py"
    script.write_text("import sys\nfrom bench import harness\n"
                      "harness.serve_worker(lambda request: {'doubled': request * 2, 'path0': sys.path[1]})\n")
    worker = harness.TreeWorker(script, harness.ROOT, [], tmp_path / "worker.log")
    try:
        answer = worker.ask(21)
    finally:
        worker.close()
    assert answer["doubled"] == 42
    assert worker.process.returncode == 0
    assert Path(answer["path0"]) == harness.ROOT


def test_model_path_saves_the_tiny_model_once_and_passes_names_through(tmp_path):
    assert harness.model_path("SmolLM2-135M-Instruct", tmp_path) == "SmolLM2-135M-Instruct"
    saved = harness.model_path("tiny", tmp_path)
    assert (Path(saved) / "config.json").is_file()
    assert harness.model_path("tiny", tmp_path) == saved


@pytest.mark.e2e
def test_a_daemon_started_by_the_harness_stops_with_its_stack(tmp_path):
    with ExitStack() as stack:
        daemon = harness.start_daemon(stack, tmp_path, "--max-bytes", "1M", name="data")
        assert daemon.process.poll() is None and (tmp_path / "data").is_dir()
    assert daemon.process.poll() == 0
