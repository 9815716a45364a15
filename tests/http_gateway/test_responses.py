"""Whole responses: usage always has cached_tokens, n choices count the prompt once, logprobs in both shapes."""
from __future__ import annotations

import pytest

from http_gateway.responses import Collected, chat_completion, completion, completion_logprobs, usage
from kvboost.v1 import inference_pb2 as pb
from tests.http_gateway.factories import logprob, result, token


def collected(*events) -> Collected:
    gathered = Collected(n=max(event.index for event in events) + 1)
    for event in events:
        gathered.add(event)
    return gathered


def test_usage_always_carries_cached_tokens_even_zero():
    assert usage([pb.GenerationResult(prompt_tokens=5, generated_tokens=3)]) == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}


def test_n_choices_count_the_prompt_once_and_every_completion_token():
    body = chat_completion("chatcmpl-1", 100, "m", collected(
        token("Hel", 1), token("Yo", 7, index=1), token("lo", 2), result(0, generated=2, finish="eos"),
        result(1, generated=1, finish="length")), logprobs=False)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hello", "stop"), (1, "Yo", "length")]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert body["object"] == "chat.completion" and body["choices"][0]["logprobs"] is None
    assert body["kvboost"]["mode"] == "prefix_cache" and body["kvboost"]["cached_tokens"] == 4


def test_chat_logprobs_have_bytes_and_alternatives():
    item = logprob(1, "é", -0.5, top=((1, "é", -0.5), (2, "e", -1.0)))
    body = chat_completion("c", 0, "m", collected(token("é", 1, logprobs=(item,)), result()), logprobs=True)
    assert body["choices"][0]["logprobs"]["content"] == [{
        "token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9],
        "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [0xC3, 0xA9]},
                         {"token": "e", "logprob": -1.0, "bytes": [0x65]}]}]


def test_completion_echo_puts_the_prompt_and_its_logprobs_first():
    prompt_scores = [logprob(5, "Hi", None), logprob(6, "!", -2.0, top=((6, "!", -2.0),))]
    first = pb.GenerateEvent(prompt_logprobs=prompt_scores)
    body = completion("cmpl-1", 0, "m", collected(first, token(" ok", 9, logprobs=(logprob(9, " ok", -0.25),)),
                                                  result()), echo_prompt="Hi!", logprobs=True)
    choice = body["choices"][0]
    assert choice["text"] == "Hi! ok"
    assert choice["logprobs"] == {"tokens": ["Hi", "!", " ok"], "token_logprobs": [None, -2.0, -0.25],
                                  "top_logprobs": [None, {"!": -2.0}, {}], "text_offset": [0, 2, 3]}


def test_completion_logprobs_offsets_start_where_asked():
    assert completion_logprobs([logprob(1, "ab", -1.0)], text_offset=7)["text_offset"] == [7]


def test_a_choice_without_result_reads_as_aborted():
    body = completion("c", 0, "m", Collected(n=1), echo_prompt=None, logprobs=False)
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize("reason, expected", [("eos", "stop"), ("stop", "stop"), ("length", "length"),
                                              ("cancelled", "abort")])
def test_finish_reasons_in_openai_words(reason, expected):
    body = completion("c", 0, "m", collected(result(finish=reason)), echo_prompt=None, logprobs=False)
    assert body["choices"][0]["finish_reason"] == expected
