"""Chunk boundaries: fixed cuts, segments chunked from their own start, the boundary window."""
from __future__ import annotations

import pytest

from kvboost_keys.chunking import Chunk, ChunkPlan, find_cuts, plan_chunks, plan_segments

PERIOD = 0  # the sentence-end token in the boundary tests


def make_tokens(count: int, first: int = 100) -> list[int]:
    """Distinct non-boundary token ids first, first + 1, ..."""
    return list(range(first, first + count))


def spans(plan: ChunkPlan) -> list[tuple[int, int]]:
    return [(chunk.start, chunk.end) for chunk in plan.chunks]


def is_period(token_id: int) -> bool:
    return token_id == PERIOD


def with_periods(count: int, period_indices: list[int]) -> list[int]:
    tokens = make_tokens(count)
    for index in period_indices:
        tokens[index] = PERIOD
    return tokens


# --- fixed-size chunks -------------------------------------------------------------------------


def test_ten_tokens_give_two_chunks_and_a_two_token_tail():
    tokens = make_tokens(10)
    plan = plan_chunks(tokens, chunk_size=4)
    assert spans(plan) == [(0, 4), (4, 8)]
    assert [chunk.token_ids for chunk in plan.chunks] == [tuple(tokens[0:4]), tuple(tokens[4:8])]
    assert plan.tail == tuple(tokens[8:10])
    assert (plan.num_tokens, plan.tail_start, plan.num_chunk_tokens) == (10, 8, 8)


def test_aligned_prompt_has_no_tail():
    plan = plan_chunks(make_tokens(8), chunk_size=4)
    assert spans(plan) == [(0, 4), (4, 8)]
    assert plan.tail == ()
    assert plan.tail_start == 8


def test_one_token_past_a_boundary_is_a_one_token_tail():
    tokens = make_tokens(9)
    plan = plan_chunks(tokens, chunk_size=4)
    assert spans(plan) == [(0, 4), (4, 8)]
    assert plan.tail == (tokens[8],)


def test_prompt_shorter_than_a_chunk_is_all_tail():
    plan = plan_chunks(make_tokens(3), chunk_size=4)
    assert plan.chunks == ()
    assert plan.tail == tuple(make_tokens(3))


def test_empty_prompt_plans_nothing():
    plan = plan_chunks([], chunk_size=4)
    assert (plan.chunks, plan.tail, plan.num_tokens) == ((), (), 0)
    assert plan_segments([], chunk_size=4) == ChunkPlan((), (), 0)


def test_find_cuts_without_a_window():
    assert find_cuts(10, 4) == [4, 8]
    assert find_cuts(8, 4) == [4, 8]
    assert find_cuts(3, 4) == []
    assert find_cuts(0, 4) == []


def test_invalid_arguments_are_refused():
    with pytest.raises(AssertionError, match="chunk_size"):
        find_cuts(10, 0)
    with pytest.raises(AssertionError, match="boundary_window"):
        find_cuts(10, 4, boundary_window=-1)
    with pytest.raises(AssertionError, match="at least one token"):
        Chunk((), 0, 0)


# --- segments ----------------------------------------------------------------------------------


def test_each_segment_is_chunked_from_its_own_start():
    system, document, question = make_tokens(6, 100), make_tokens(5, 200), make_tokens(6, 300)
    plan = plan_segments([system, document, question], chunk_size=4)
    # system: [0:4] + partial [4:6]; document at 6: [6:10] + partial [10:11];
    # question at 11: [11:15], its partial [15:17] is the tail.
    assert spans(plan) == [(0, 4), (4, 6), (6, 10), (10, 11), (11, 15)]
    assert [chunk.segment for chunk in plan.chunks] == [0, 0, 1, 1, 2]
    assert plan.chunks[1].token_ids == tuple(system[4:6])
    assert plan.chunks[3].token_ids == tuple(document[4:5])
    assert plan.tail == tuple(question[4:6])
    assert (plan.num_tokens, plan.tail_start) == (17, 15)


def test_an_empty_final_segment_leaves_no_tail():
    plan = plan_segments([make_tokens(5), []], chunk_size=4)
    assert spans(plan) == [(0, 4), (4, 5)]
    assert plan.tail == ()


def test_a_document_gives_the_same_chunks_wherever_it_appears():
    document = make_tokens(9, 500)
    first = plan_segments([make_tokens(3, 100), document, make_tokens(2, 300)], chunk_size=4)
    second = plan_segments([make_tokens(7, 700), make_tokens(4, 800), document, make_tokens(5, 300)], chunk_size=4)
    document_chunks = lambda plan, segment: [c.token_ids for c in plan.chunks if c.segment == segment]
    expected = [tuple(document[0:4]), tuple(document[4:8]), tuple(document[8:9])]
    assert document_chunks(first, 1) == document_chunks(second, 2) == expected
    # Starts are offsets in the whole prompt, so the same document sits at different starts.
    assert [c.start for c in first.chunks if c.segment == 1] == [3, 7, 11]
    assert [c.start for c in second.chunks if c.segment == 2] == [11, 15, 19]


def test_one_segment_plan_equals_plan_chunks():
    tokens = make_tokens(10)
    assert plan_segments([tokens], chunk_size=4) == plan_chunks(tokens, chunk_size=4)


# --- boundary window (chunk_size 4, window 1: the first cut may land at 3, 4 or 5) --------------


def test_cut_slides_back_to_a_sentence_end_within_the_window():
    plan = plan_chunks(with_periods(10, [2]), chunk_size=4, boundary_window=1, is_boundary=is_period)
    assert spans(plan)[0] == (0, 3)


def test_cut_slides_forward_to_a_sentence_end_within_the_window():
    plan = plan_chunks(with_periods(10, [4]), chunk_size=4, boundary_window=1, is_boundary=is_period)
    assert spans(plan)[0] == (0, 5)


def test_equally_near_sentence_ends_tie_to_the_earlier_cut():
    plan = plan_chunks(with_periods(10, [2, 4]), chunk_size=4, boundary_window=1, is_boundary=is_period)
    assert spans(plan)[0] == (0, 3)


def test_a_sentence_end_at_the_fixed_cut_wins():
    plan = plan_chunks(with_periods(10, [2, 3, 4]), chunk_size=4, boundary_window=1, is_boundary=is_period)
    assert spans(plan)[0] == (0, 4)


def test_no_sentence_end_in_the_window_keeps_the_fixed_cut():
    # A period at index 1 would mean a cut at 2: two tokens away, outside the window.
    plan = plan_chunks(with_periods(10, [1]), chunk_size=4, boundary_window=1, is_boundary=is_period)
    assert spans(plan) == [(0, 4), (4, 8)]


def test_later_cuts_count_from_the_slid_cut():
    # First cut slides to 5 (period at 4); the next target is 9, which slides to 8 (period at 7).
    plan = plan_chunks(with_periods(12, [4, 7]), chunk_size=4, boundary_window=1, is_boundary=is_period)
    assert spans(plan) == [(0, 5), (5, 8), (8, 12)]
    assert plan.tail == ()


def test_find_cuts_window_sees_indices_and_never_leaves_a_chunk_empty():
    # Window larger than the chunk: the only boundary before the cut is at index 0, but
    # index 5 (cut 6) is nearer to the target 4 than cut 1 is.
    assert find_cuts(8, 4, boundary_window=3, is_boundary=lambda i: i in (0, 5)) == [6]
    # Cut 1 (boundary at index 0) is 3 away and the only choice within the window.
    assert find_cuts(4, 4, boundary_window=3, is_boundary=lambda i: i == 0) == [1]
    # After the cut at 1 the next target is 5; the window reaches back to cut 1 again, which would
    # make an empty chunk, so the target stays fixed.
    assert find_cuts(6, 4, boundary_window=4, is_boundary=lambda i: i == 0) == [1, 5]


def test_window_is_ignored_without_a_boundary_predicate():
    assert find_cuts(10, 4, boundary_window=2) == [4, 8]
