"""rank: each policy's order of the healthy replicas (the first is where a request goes, the second its retry)."""
from __future__ import annotations

import pytest

from router.policies import Candidate, rank


def candidates(*rows: tuple[int, int, int, float]) -> list[Candidate]:
    """(index, load, num_routed, cost) rows."""
    return [Candidate(*row) for row in rows]


def test_round_robin_takes_turns_whatever_the_load():
    three = candidates((2, 0, 0, 0), (0, 5, 9, 0), (1, 0, 0, 0))
    assert [rank("round-robin", three, turn) for turn in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]


def test_round_robin_alternates_between_the_replicas_left_when_one_is_down():
    two = candidates((0, 0, 0, 0), (2, 0, 0, 0))
    assert [rank("round-robin", two, turn)[0] for turn in range(4)] == [0, 2, 0, 2]


def test_least_loaded_takes_the_lowest_load_then_the_one_sent_fewer_requests():
    assert rank("least-loaded", candidates((0, 3, 0, 0), (1, 1, 7, 0), (2, 2, 0, 0)), 0) == [1, 2, 0]
    assert rank("least-loaded", candidates((0, 1, 4, 0), (1, 1, 3, 0)), 0) == [1, 0]


def test_prefix_takes_the_lowest_cost_then_spreads_ties():
    assert rank("prefix", candidates((0, 0, 0, 900.0), (1, 2, 5, 300.0)), 0) == [1, 0]
    # Equal cost (nothing cached anywhere, no load): the replica sent fewer requests, then the lower index.
    assert rank("prefix", candidates((0, 0, 2, 50.0), (1, 0, 1, 50.0), (2, 0, 1, 50.0)), 0) == [1, 2, 0]


def test_an_unknown_policy_is_refused():
    with pytest.raises(AssertionError, match="policy must be one of"):
        rank("random", candidates((0, 0, 0, 0)), 0)
