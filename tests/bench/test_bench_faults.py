"""bench/bench_faults.py on the tiny model: ordinary answers identical beside extreme requests, every one answered."""
from __future__ import annotations

import re

import pytest

from bench import bench_faults


@pytest.mark.e2e
def test_ordinary_requests_stay_identical_beside_extreme_ones(capsys):
    assert bench_faults.main(["--model", "tiny", "--rounds", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "token-identical to model.generate in every round: True" in out
    lines = out.splitlines()
    assert sum(re.match(r"ordinary \d: ", line) is not None for line in lines) == 4
    assert sum(line.startswith("extreme ") for line in lines) == 4
