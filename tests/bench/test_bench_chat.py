"""bench/bench_chat.py on SmolLM2 (short): from the second turn on, only the new message is recomputed."""
from __future__ import annotations

import re

import pytest

from bench import bench_chat


@pytest.mark.slow
@pytest.mark.e2e
def test_later_turns_recompute_only_their_new_message(capsys):
    assert bench_chat.main(["--turns", "3", "--answer-tokens", "12", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    turns = re.findall(r"turn (\d): prompt +(\d+) tokens, cached +(\d+), recomputed +(\d+) \(new since the last "
                       r"turn's answer: +(-?\d+)\)", out)
    assert len(turns) == 3
    for _, _, _, recomputed, new in turns[1:]:
        # The previous turn's answer (but its last token, whose K/V was never computed) came from the cache.
        assert int(recomputed) <= int(new) + 1
    assert "identical to BASELINE on every turn: True" in out
