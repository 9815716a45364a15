"""Stream chunks of chat and completions, as OpenAI sends them: one formatter per response (pure; no I/O)."""
from __future__ import annotations

from http_gateway.responses import (
    chat_logprob_items, completion_logprobs, finish_reason, kvboost_details, kvboost_prefill_details, usage,
)
from kvboost.v1 import inference_pb2 as pb


class _StreamFormatter:
    """Turns each GenerateEvent into zero or more chunk bodies; `end()` gives the usage chunk when asked for.

    Whatever stream_options says, each choice's first content chunk carries `kvboost` with `approximate` (as its
    first event said), and its finish chunk the whole `kvboost` block (approximate included)."""

    object_name = ""

    def __init__(self, response_id: str, created: int, model: str, n: int, include_usage: bool,
                 logprobs: bool) -> None:
        self.response_id, self.created, self.model = response_id, created, model
        self.n = n
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.results: dict[int, pb.GenerationResult] = {}
        # What the first token's event said of the prompt (the n choices share it); before one came, nothing was
        # looked up yet, or the request asked for prompt logprobs, which never looks its prompt up: exact.
        self.prefill = {"approximate": False, "approximate_tokens": 0}
        self.noted_prefill = False
        self.said_prefill: set[int] = set()  # choices whose first content chunk went out

    def note_prefill(self, event: pb.GenerateEvent) -> None:
        """Keeps what the first token's event says of the prompt (the event may carry no text yet)."""
        if not self.noted_prefill and event.token_ids:
            self.prefill, self.noted_prefill = kvboost_prefill_details(event), True

    def content_chunk(self, index: int, choice: dict) -> dict:
        """A chunk of choice content: the choice's first one carries the prefill details."""
        body = self.chunk([choice])
        if index not in self.said_prefill:
            self.said_prefill.add(index)
            body["kvboost"] = dict(self.prefill)
        return body

    def finish_chunk(self, index: int, choice: dict, result: pb.GenerationResult) -> dict:
        body = self.chunk([choice])
        body["kvboost"] = kvboost_details(result)
        return body

    def chunk(self, choices: list[dict]) -> dict:
        body = {"id": self.response_id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage:
            body["usage"] = None  # every chunk but the last, as OpenAI does
        return body

    def end(self) -> list[dict]:
        if not self.include_usage:
            return []
        results = [self.results[index] for index in sorted(self.results)]
        body = self.chunk([])
        body["usage"] = usage(results)
        if results:
            body["kvboost"] = kvboost_details(results[0])
        return [body]


class ChatStream(_StreamFormatter):
    object_name = "chat.completion.chunk"

    def start(self) -> list[dict]:
        """The first chunk of every choice: the assistant's role."""
        return [self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for index in range(self.n)]

    def on_event(self, event: pb.GenerateEvent) -> list[dict]:
        if event.HasField("result"):
            self.results[event.index] = event.result
            return [self.finish_chunk(event.index, {"index": event.index, "delta": {}, "logprobs": None,
                                                    "finish_reason": finish_reason(event.result)}, event.result)]
        self.note_prefill(event)
        if not event.text and not (self.logprobs and event.logprobs):
            return []
        logprobs = {"content": chat_logprob_items(event.logprobs), "refusal": None} if self.logprobs else None
        return [self.content_chunk(event.index, {"index": event.index, "delta": {"content": event.text},
                                                 "logprobs": logprobs, "finish_reason": None})]


class CompletionStream(_StreamFormatter):
    object_name = "text_completion"

    def __init__(self, *args, echo_prompt: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo_prompt = echo_prompt
        self.offsets = [len(echo_prompt or "")] * self.n  # text_offset of each choice's next token

    def start(self) -> list[dict]:
        return []

    def on_event(self, event: pb.GenerateEvent) -> list[dict]:
        chunks = []
        self.note_prefill(event)  # before the echo: the echoed prompt is each choice's first content chunk
        if self.echo_prompt is not None:  # the first event: the prompt comes first, once per choice
            chunks += [self._text(index, self.echo_prompt, list(event.prompt_logprobs), 0) for index in range(self.n)]
            self.echo_prompt = None
        if event.HasField("result"):
            self.results[event.index] = event.result
            chunks.append(self.finish_chunk(event.index, {"index": event.index, "text": "", "logprobs": None,
                                                          "finish_reason": finish_reason(event.result)}, event.result))
            return chunks
        if event.text or (self.logprobs and event.logprobs):
            chunks.append(self._text(event.index, event.text, list(event.logprobs), self.offsets[event.index]))
            self.offsets[event.index] += sum(len(item.text) for item in event.logprobs)
        return chunks

    def _text(self, index: int, text: str, items: list[pb.TokenLogprob], offset: int) -> dict:
        logprobs = completion_logprobs(items, offset) if self.logprobs else None
        return self.content_chunk(index, {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None})
