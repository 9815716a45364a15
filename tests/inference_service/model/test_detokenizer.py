"""Incremental detokenizing: whole characters only, stop strings cut, streamed pieces add up."""
from __future__ import annotations

from inference_service.model.detokenizer import IncrementalDetokenizer
from tests.factories import build_byte_tokenizer


def feed(text: str, stop=(), prompt: str = "Q: ") -> tuple[list[str], IncrementalDetokenizer]:
    tokenizer = build_byte_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer(prompt)["input_ids"], stop)
    pieces = [detokenizer.add(token_id) for token_id in tokenizer(text)["input_ids"]]
    pieces.append(detokenizer.finish())
    return pieces, detokenizer


def test_pieces_concatenate_to_the_text():
    pieces, detokenizer = feed("hello world")
    assert "".join(pieces) == detokenizer.text == "hello world"
    assert pieces[:3] == ["h", "e", "l"]


def test_multibyte_characters_come_out_whole():
    # "é" is two bytes, "🙂" four: the byte tokenizer gives one token per byte.
    pieces, detokenizer = feed("é🙂!")
    assert [p for p in pieces if p] == ["é", "🙂", "!"]
    assert detokenizer.text == "é🙂!"


def test_stop_string_cuts_before_the_first_match_and_is_never_streamed():
    pieces, detokenizer = feed("abc STOP def STOP", stop=("STOP",))
    assert detokenizer.stopped and detokenizer.text == "abc "
    assert "".join(pieces) == "abc "


def test_earliest_of_several_stop_strings_wins():
    _, detokenizer = feed("one two three", stop=("three", "two"))
    assert detokenizer.text == "one "


def test_held_back_text_is_released_when_no_stop_follows():
    pieces, detokenizer = feed("xx ST yy", stop=("STOP",))
    assert not detokenizer.stopped and "".join(pieces) == "xx ST yy"
    assert pieces[-1] != ""  # the tail that could have begun "STOP" came out at finish


def test_special_tokens_add_no_text():
    tokenizer = build_byte_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [], ())
    assert detokenizer.add(tokenizer.eos_token_id) == ""
    assert detokenizer.finish() == "" and detokenizer.text == ""


def test_tokens_after_a_stop_are_ignored():
    tokenizer = build_byte_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [], ("b",))
    [detokenizer.add(t) for t in tokenizer("ab")["input_ids"]]
    assert detokenizer.add(tokenizer("c")["input_ids"][0]) == "" and detokenizer.text == "a"
