"""estimate_reuse and expected_cost: what a replica holding some keys would reuse of a prompt (chunk size 4)."""
from __future__ import annotations

import pytest

from kvboost_keys.chunk_keys import hash_prefix_chunk
from kvboost_keys.namespace import Namespace
from kvboost_keys.prompts import plan_prompt
from router.scoring import CostWeights, ReuseEstimate, estimate_reuse, expected_cost

NAMESPACE = Namespace(bytes(32))
# Three whole chunks and a tail of two: [0 1 2 3] [4 5 6 7] [8 9 10 11] | 12 13
PLAN = plan_prompt(NAMESPACE, [list(range(14))], chunk_size=4)


def holding(*keys: bytes):
    held = set(keys)
    return held.__contains__


def test_the_leading_run_of_prefix_keys_counts_until_the_first_miss():
    first, second, third = PLAN.prefix_keys
    assert estimate_reuse(PLAN, holding(first, second), None) == ReuseEstimate(8, 0)
    # A later chunk held by prefix key without the one before it is no part of the run.
    assert estimate_reuse(PLAN, holding(first, third), None) == ReuseEstimate(4, 0)
    assert estimate_reuse(PLAN, holding(), None) == ReuseEstimate(0, 0)


def test_a_stored_partial_chunk_extends_the_run_to_its_last_token():
    first = PLAN.prefix_keys[0]
    # A stored partial chunk of [4 5 6] after the first chunk (an earlier prompt ended there).
    partial = hash_prefix_chunk(first, [4, 5, 6])
    assert estimate_reuse(PLAN, holding(first, partial), None) == ReuseEstimate(7, 0)
    # The whole prompt's tail stored (the same prompt asked before): every token reused.
    assert estimate_reuse(PLAN, holding(*PLAN.prefix_keys, PLAN.tail_key), None) == ReuseEstimate(14, 0)


def test_content_hits_after_the_run_count_apart_and_only_when_the_mode_reuses_them():
    first = PLAN.prefix_keys[0]
    _, second_content, third_content = PLAN.content_keys
    holds_content = holding(third_content)
    assert estimate_reuse(PLAN, holding(first), holds_content) == ReuseEstimate(4, 4)
    assert estimate_reuse(PLAN, holding(first), holding(second_content, third_content)) == ReuseEstimate(4, 8)
    assert estimate_reuse(PLAN, holding(first), None) == ReuseEstimate(4, 0)  # PREFIX_CACHE


def test_a_chunk_partly_reused_exactly_is_not_also_a_content_hit():
    first = PLAN.prefix_keys[0]
    partial = hash_prefix_chunk(first, [4, 5])
    second_content = PLAN.content_keys[1]
    assert estimate_reuse(PLAN, holding(first, partial), holding(second_content)) == ReuseEstimate(6, 0)


def test_expected_cost_is_tokens_left_plus_load():
    weights = CostWeights(content_weight=0.5, load_cost_tokens=100)
    # 14 tokens, 8 exact, 4 by content at half weight: 4 left; 2 requests of load: 200.
    assert expected_cost(14, ReuseEstimate(8, 4), load=2, weights=weights) == 204.0
    assert expected_cost(14, ReuseEstimate(0, 0), load=0, weights=weights) == 14.0


def test_weights_are_checked():
    with pytest.raises(AssertionError, match="content_weight"):
        CostWeights(content_weight=1.5)
    with pytest.raises(AssertionError, match="load_cost_tokens"):
        CostWeights(load_cost_tokens=-1)
