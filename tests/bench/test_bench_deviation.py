"""bench/bench_deviation.py runs end to end on SmolLM2 and prints both of its tables."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def test_one_question_prints_every_layer_and_each_repair(capsys, smollm2):
    import bench_deviation

    model, _, _ = smollm2
    bench_deviation.main(["--questions", "1", "--ratios", "0.15,1.0", "--threads", "1"])
    out = capsys.readouterr().out
    layer_rows = [line for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(layer_rows) == model.config.num_hidden_layers
    first_layer = [float(cell) for cell in layer_rows[0].split()[1:]]
    assert first_layer == [0.0, 0.0, 0.0, 0.0], "layer 0 K/V depend on token and position only"
    repairs = {line.split()[0] + " " + line.split()[1]: line.split()[-2:] for line in out.splitlines()
               if line.startswith(("full prefill", "reuse none", "cacheblend", "oracle"))}
    assert set(repairs) == {"full prefill", "reuse none", "cacheblend 15%", "oracle 15%", "cacheblend 100%",
                            "oracle 100%"}
    # Recomputing every reused token in the later layers is full prefill again: first-token KL ~ 0.
    assert float(repairs["cacheblend 100%"][1]) < 1e-6
    assert float(repairs["reuse none"][1]) > 1e-3
