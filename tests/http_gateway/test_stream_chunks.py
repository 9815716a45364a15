"""Stream chunks in OpenAI's order: role first, content deltas, a finish chunk per choice, usage last when asked."""
from __future__ import annotations

from http_gateway.stream_chunks import ChatStream, CompletionStream
from kvboost.v1 import inference_pb2 as pb
from tests.http_gateway.factories import logprob, result, token


def run(formatter, *events) -> list[dict]:
    chunks = formatter.start()
    for event in events:
        chunks += formatter.on_event(event)
    return chunks + formatter.end()


def test_chat_stream_without_usage():
    chunks = run(ChatStream("id", 1, "m", n=1, include_usage=False, logprobs=False),
                 token("Hel", 1), token("", 2), token("lo", 3), result(finish="eos"))
    assert [chunk["choices"][0]["delta"] for chunk in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, None, "stop"]
    assert all("usage" not in chunk and chunk["object"] == "chat.completion.chunk" for chunk in chunks)


def test_include_usage_gives_null_usage_then_one_last_chunk_without_choices():
    chunks = run(ChatStream("id", 1, "m", n=2, include_usage=True, logprobs=False),
                 token("a", 1, index=0), token("b", 2, index=1), result(0, generated=1), result(1, generated=1))
    *body, last = chunks
    assert all(chunk["usage"] is None and chunk["choices"] for chunk in body)
    assert [chunk["choices"][0]["index"] for chunk in body] == [0, 1, 0, 1, 0, 1]
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 4}}


def test_chat_stream_sends_logprobs_even_for_held_back_text():
    chunks = run(ChatStream("id", 1, "m", n=1, include_usage=False, logprobs=True),
                 token("", 1, logprobs=(logprob(1, "\ufffd", -1.0),)))
    assert chunks[1]["choices"][0]["delta"] == {"content": ""}
    assert chunks[1]["choices"][0]["logprobs"]["content"][0]["logprob"] == -1.0


def test_completion_stream_echoes_the_prompt_first_for_every_choice():
    first = pb.GenerateEvent(prompt_logprobs=[logprob(1, "Hi", None)])
    chunks = run(CompletionStream("id", 1, "m", n=2, include_usage=False, logprobs=True, echo_prompt="Hi"),
                 first, token("!", 2, index=1, logprobs=(logprob(2, "!", -0.5),)), result(0), result(1))
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == [
        (0, "Hi"), (1, "Hi"), (1, "!"), (0, ""), (1, "")]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None]
    assert chunks[2]["choices"][0]["logprobs"]["text_offset"] == [2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
