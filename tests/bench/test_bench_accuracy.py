"""bench/bench_accuracy.py runs end to end on SmolLM2: the identity table's storage rows, and the JSON it writes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def test_identity_table_has_every_storage_row(capsys, smollm2, tmp_path):
    import bench_accuracy

    bench_accuracy.main(["--no-questions", "--questions", "1", "--identity-prompts", "1", "--threads", "1",
                         "--out", str(tmp_path)])
    out = capsys.readouterr().out
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("|")]
    rows = {row[0]: row[1:] for row in cells if row[0] in {name for name, _, _ in bench_accuracy.STORAGE}}
    assert set(rows) == {name for name, _, _ in bench_accuracy.STORAGE}
    # columns: prompts, with hits, same output, same tokens, first-token KL, bytes stored, x fewer, x fewer than fp16
    # 16-bit K/V are stored bit-exact (tests/inference_service/kv/test_codec.py); the first token's logits then
    # come from a one-token prefill over them, which rounds differently from a full prefill in the last bits.
    assert int(rows["16-bit"][1]) >= 1 and rows["16-bit"][2:4] == ["1.000", "1.000"]
    assert float(rows["16-bit"][4]) < 1e-9
    assert float(rows["8-bit"][4]) > 0 and float(rows["4-bit"][4]) > float(rows["8-bit"][4])
    assert 1.85 < float(rows["8-bit"][7]) < 1.95 and 3.5 < float(rows["4-bit"][7]) < 3.9
    assert rows["8-bit"][5] == rows["8-bit, keys before RoPE"][5], "where keys are rotated costs no bytes"
    written = json.loads(next(tmp_path.glob("accuracy-*.json")).read_text())
    before = {name: row["keys_before_rope"] for name, row in written["identity"].items()}
    assert written["table"] == [] and before == {"16-bit": False, "8-bit": False, "8-bit, keys before RoPE": True,
                                                 "4-bit": False, "4-bit, keys before RoPE": True}


def test_the_guard_is_tuned_to_the_largest_threshold_within_the_target():
    import bench_accuracy

    rows = {
        "full prefill": {"correct": [True, True, True, False], "ttft_ms": [100.0, 100.0, 100.0, 100.0]},
        "cb": {"correct": [False, True, True, False], "ttft_ms": [30.0, 30.0, 30.0, 30.0],
               "risk": [0.5, 0.1, 0.2, 0.05]},
    }
    # Only question 0 loses an answer; it has the highest risk, so any threshold below 0.5 recovers it.
    assert bench_accuracy.tune_guard(rows, "cb", target=0.0) == pytest.approx(0.5, rel=1e-6)
    assert bench_accuracy.tune_guard(rows, "cb", target=0.25) == float("inf")  # never falling back loses 0.25
    correct, ttft, share = bench_accuracy.guarded_answers(rows["full prefill"], rows["cb"], 0.15)
    assert correct == [True, True, True, False] and ttft == [100.0, 30.0, 100.0, 30.0] and share == 0.5
    curve = bench_accuracy.guard_curve(rows, "cb")
    assert [point["fallback_share"] for point in curve] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert curve[-1]["accuracy"] == 0.5 and curve[0]["accuracy"] == 0.75


def test_the_bootstrap_interval_brackets_the_mean():
    import bench_accuracy

    values = [True] * 30 + [False] * 70
    low, high = bench_accuracy.bootstrap_interval(values)
    assert low < 0.3 < high and high - low < 0.25
    assert bench_accuracy.bootstrap_interval([True] * 10) == (1.0, 1.0)


@pytest.mark.slow
def test_the_guard_runs_end_to_end_on_two_splits(capsys, smollm2, tmp_path, monkeypatch):
    """Tuned on one split, checked on the other, tabled and plotted. Over 8 of the 24 documents: every column's
    engine warms every document before its questions (twice here: once per split), and which documents the
    four questions draw from changes nothing of what this checks; the full set is the benchmark's."""
    import bench_accuracy

    all_documents = bench_accuracy.build_documents
    monkeypatch.setattr(bench_accuracy, "build_documents", lambda: all_documents()[:8])
    bench_accuracy.main(["--no-identity", "--questions", "4", "--columns", "cacheblend 15%", "--threads", "1",
                         "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "guard threshold tuned on the development split" in out and "cacheblend 15% + guard" in out
    written = json.loads(next(tmp_path.glob("accuracy-*.json")).read_text())
    assert written["guard"]["dev_questions"] == 2 and written["guard"]["held_out_questions"] == 2
    assert [row["column"] for row in written["table"]] == ["full prefill", "cacheblend 15%", "cacheblend 15% + guard"]
    assert list(tmp_path.glob("accuracy-*.png"))
