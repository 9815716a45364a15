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
    rows = {name: line[len(name):].split() for line in out.splitlines()
            for name, _, _ in bench_accuracy.STORAGE if line.startswith(name + " ")}
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
