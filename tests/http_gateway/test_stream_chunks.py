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


def approximate_token(text: str, token_id: int, index: int = 0, approximate_tokens: int = 96) -> pb.GenerateEvent:
    """A completion's first token event when its prompt reused content hits."""
    return pb.GenerateEvent(text=text, token_ids=[token_id], index=index, approximate=True,
                            approximate_tokens=approximate_tokens)


def approximate_result(index: int = 0) -> pb.GenerateEvent:
    event = result(index)
    event.result.approximate, event.result.approximate_tokens, event.result.mode = True, 96, pb.CHUNK_KV_REUSE
    return event


def test_chat_stream_says_approximate_on_the_first_content_chunk_and_the_finish_chunk_without_usage():
    # The first token's text is held back (empty): the label waits for the first chunk with content.
    chunks = run(ChatStream("id", 1, "m", n=1, include_usage=False, logprobs=False),
                 approximate_token("", 1), token("Hi", 2), token("!", 3), approximate_result())
    labels = [chunk.get("kvboost") for chunk in chunks]
    assert labels[0] is None  # the role chunk
    assert labels[1] == {"approximate": True, "approximate_tokens": 96}
    assert labels[2] is None
    assert labels[-1]["approximate"] is True and labels[-1]["approximate_tokens"] == 96
    assert labels[-1]["mode"] == "chunk_kv_reuse"


def test_an_exact_stream_says_approximate_false_on_the_same_chunks():
    chunks = run(ChatStream("id", 1, "m", n=2, include_usage=True, logprobs=False),
                 token("a", 1, index=0), token("b", 2, index=1), token("c", 3, index=0), result(0), result(1))
    labelled = [(chunk["choices"][0]["index"] if chunk["choices"] else None, chunk["kvboost"]["approximate"])
                for chunk in chunks if "kvboost" in chunk]
    # Each choice's first content chunk, each finish chunk, and the usage chunk.
    assert labelled == [(0, False), (1, False), (0, False), (1, False), (None, False)]


def test_completion_stream_labels_the_echoed_prompt_as_the_first_content_chunk_of_every_choice():
    chunks = run(CompletionStream("id", 1, "m", n=2, include_usage=False, logprobs=False, echo_prompt="Hi"),
                 approximate_token("!", 2, index=1), approximate_token("?", 3, index=0), approximate_result(0),
                 approximate_result(1))
    first_of_each = [chunk["kvboost"] for chunk in chunks[:2]]
    assert [chunk["choices"][0]["text"] for chunk in chunks[:2]] == ["Hi", "Hi"]
    assert first_of_each == [{"approximate": True, "approximate_tokens": 96}] * 2
    assert all("kvboost" not in chunk for chunk in chunks[2:4])  # later content chunks
    assert [chunk["kvboost"]["approximate"] for chunk in chunks[4:]] == [True, True]
