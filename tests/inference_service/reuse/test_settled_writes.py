"""settled_writes: an early Lookup goes out of date only when a write-back stored what THIS prompt missed."""
from __future__ import annotations

from inference_service.reuse.settled_writes import SettledLog, SettledWrite, overtakes, shared_tokens, still_current
from kvboost_keys.chunk_keys import encode_token_ids
from inference_service.store.protocol import StoreLookup
from kvboost_keys.prompts import PromptPlan, plan_prompt

NAMESPACE = b"n" * 32
CHUNK = 4


def make_prompt(*token_ids: int) -> PromptPlan:
    return plan_prompt(NAMESPACE, [list(token_ids)], CHUNK)


def write_of(prompt: PromptPlan, first_chunk: int = 0, with_tail: bool = True) -> SettledWrite:
    """What new_chunks hands the write-back for `prompt` after a run of first_chunk chunks: its chunks, then its tail
    as a partial chunk."""
    chunks = list(prompt.chunks.chunks[first_chunk:])
    keys = list(prompt.prefix_keys[first_chunk:])
    contents = list(prompt.content_keys[first_chunk:])
    parents = [prompt.parent_key(index) for index in range(first_chunk, len(prompt.chunks.chunks))]
    tokens = [chunk.token_ids for chunk in chunks]
    if with_tail and prompt.tail_key is not None:
        keys.append(prompt.tail_key)
        contents.append(None)
        parents.append(prompt.parent_key(len(prompt.chunks.chunks)))
        tokens.append(prompt.chunks.tail)
    return SettledWrite.of(keys, contents, parents, tokens)


DOCUMENT = (10, 11, 12, 13, 14, 15, 16, 17)  # two whole chunks


def test_an_unrelated_prompts_write_back_does_not_overtake() -> None:
    prompt = make_prompt(*DOCUMENT, 20, 21)
    other = make_prompt(50, 51, 52, 53, 54, 55, 56, 57, 58)  # shares no leading token, so no continuation either
    assert not overtakes(write_of(other), prompt, StoreLookup(0), with_content_hits=False)
    assert not overtakes(write_of(other), prompt, StoreLookup(2), with_content_hits=False)


def test_a_write_back_of_one_of_the_prompts_missing_chunks_overtakes() -> None:
    prompt = make_prompt(*DOCUMENT, 20, 21)
    # Another question on the same document stores the document's two chunks (and its own tail).
    same_document = make_prompt(*DOCUMENT, 30)
    assert overtakes(write_of(same_document), prompt, StoreLookup(0), with_content_hits=False)
    # Once the answer found both chunks, the other prompt's tail (30 after them) shares nothing with 20, 21.
    assert not overtakes(write_of(same_document, first_chunk=2), prompt, StoreLookup(2), with_content_hits=False)


def test_a_chunk_before_the_run_found_does_not_overtake() -> None:
    # The answer already found the first chunk: its write-back (by another request) changes nothing.
    prompt = make_prompt(*DOCUMENT, 20, 21)
    first_only = SettledWrite.of([prompt.prefix_keys[0]], [None], [NAMESPACE], [DOCUMENT[:CHUNK]])
    assert not overtakes(first_only, prompt, StoreLookup(1), with_content_hits=False)
    second = SettledWrite.of([prompt.prefix_keys[1]], [None], [prompt.prefix_keys[0]], [DOCUMENT[CHUNK:]])
    assert overtakes(second, prompt, StoreLookup(1), with_content_hits=False)


def test_a_longer_partial_chunk_or_continuation_after_the_run_overtakes() -> None:
    # The next turn of a chat: the document's chunks were found, the tokens after them are new.
    prompt = make_prompt(*DOCUMENT, 20, 21, 22)
    tail_of_earlier_turn = make_prompt(*DOCUMENT, 20, 21)  # its tail (20, 21) is this prompt's (20, 21, 22) start
    write = write_of(tail_of_earlier_turn, first_chunk=2)
    assert overtakes(write, prompt, StoreLookup(2), with_content_hits=False)
    # The answer already found a continuation sharing those two tokens: nothing longer was stored.
    found = StoreLookup(2, continuation_key=b"k" * 32, continuation_tokens=2, continued=True)
    assert not overtakes(write, prompt, found, with_content_hits=False)
    found_partial = StoreLookup(2, continued=True, partial_key=b"p" * 32, partial_tokens=2)
    assert not overtakes(write, prompt, found_partial, with_content_hits=False)
    # The same tokens chained from another parent continue another run: not this prompt's.
    elsewhere = SettledWrite.of([b"x" * 32], [None], [b"y" * 32], [(20, 21)])
    assert not overtakes(elsewhere, prompt, StoreLookup(2), with_content_hits=False)


def test_content_keys_count_only_when_the_lookup_asked_for_content_hits() -> None:
    prompt = make_prompt(*DOCUMENT, 20, 21)
    # The document's second chunk stored after another first chunk: same content key, another prefix key and parent.
    moved = make_prompt(60, 61, 62, 63, *DOCUMENT[CHUNK:])
    write = SettledWrite.of([moved.prefix_keys[1]], [moved.content_keys[1]], [moved.prefix_keys[0]],
                            [DOCUMENT[CHUNK:]])
    assert moved.content_keys[1] == prompt.content_keys[1]
    assert not overtakes(write, prompt, StoreLookup(0), with_content_hits=False)
    assert overtakes(write, prompt, StoreLookup(0), with_content_hits=True)
    # A content hit the answer already holds is not missed.
    assert not overtakes(write, prompt, StoreLookup(0, {1: moved.prefix_keys[1]}), with_content_hits=True)


def test_a_write_back_that_names_no_parents_overtakes_any_answer() -> None:
    prompt = make_prompt(*DOCUMENT, 20, 21)
    assert overtakes(SettledWrite.of([b"z" * 32], [None], [], [(99,)]), prompt, StoreLookup(0), False)


def test_the_log_answers_what_ended_after_a_mark_and_forgets_the_oldest() -> None:
    log = SettledLog(capacity=2)
    prompt = make_prompt(*DOCUMENT, 20, 21)
    unrelated = write_of(make_prompt(50, 51, 52, 53, 54))
    mark = log.num_settled
    assert still_current(log, mark, prompt, StoreLookup(0), False)
    log.add(unrelated)
    assert log.since(mark) == [unrelated] and still_current(log, mark, prompt, StoreLookup(0), False)
    log.add(write_of(make_prompt(*DOCUMENT, 30)))
    assert log.num_settled == 2 and not still_current(log, mark, prompt, StoreLookup(0), False)
    # A mark taken after the overtaking write-back sees none of it.
    assert still_current(log, 2, prompt, StoreLookup(0), False) and log.since(2) == []
    # A third write-back pushes the first out: an answer asked before it can no longer be judged.
    log.add(unrelated)
    assert log.since(mark) is None and not still_current(log, mark, prompt, StoreLookup(0), False)
    assert log.since(1) is not None


def test_shared_tokens_counts_whole_equal_token_ids() -> None:
    ids = [5, 70000, 3, 9, 11]
    assert shared_tokens(encode_token_ids(ids), encode_token_ids(ids)) == 5
    assert shared_tokens(encode_token_ids(ids), encode_token_ids(ids[:3])) == 3
    assert shared_tokens(encode_token_ids(ids), encode_token_ids([5, 70000 + (1 << 24), 3])) == 1  # a high byte differs
    assert shared_tokens(encode_token_ids(ids), encode_token_ids([6])) == 0
    assert shared_tokens(b"", encode_token_ids(ids)) == 0
