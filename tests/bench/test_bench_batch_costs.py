"""bench/bench_batch_costs.py on the tiny model: every figure it promises is printed, with a per-token cost."""
from __future__ import annotations

import re

import pytest

from bench import bench_batch_costs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_it_prints_decode_steps_per_batch_size_and_prefills_alone_and_together(capsys) -> None:
    assert bench_batch_costs.main(["--model", "tiny", "--context", "40", "--rows", "1", "4", "--repeats", "1",
                                   "--question-tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"decode step,   1 rows: +[\d.]+ ms, +[\d.]+ ms per token$", lines[1])
    assert re.match(r"decode step,   4 rows: .* ms per token, a batched token costs [\d.]+ of a lone one$", lines[2])
    assert re.match(r"prefill of 6 tokens after 40 cached, alone: +[\d.]+ ms", lines[3])
    assert [re.search(r"(\d+) in one forward", line).group(1) for line in lines[4:6]] == ["4", "16"]
