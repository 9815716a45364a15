"""Turns generated token ids into streamed text: whole characters only, cut before the first stop string."""
from __future__ import annotations

from typing import Sequence

# Prompt tokens kept as left context, so tokenizers that drop a leading space on a lone
# token (SentencePiece) decode the first generated token as they would in the sequence.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what a partial UTF-8 sequence decodes to


class IncrementalDetokenizer:
    """Decodes only a short window of tokens per step (never the whole output again).

    Text that may be the start of a stop string is held back until it is known not to be one,
    so the streamed pieces always concatenate to the final, cut output.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = len(self._ids)  # first id whose text is not yet in self.text
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._emitted = 0  # characters of self.text already returned
        self.text = ""
        self.stopped = False  # a stop string matched; self.text is cut before it

    def add(self, token_id: int) -> str:
        """Feeds one generated token; returns the text that can be streamed now (may be empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._append(self._decode_new(final=False))
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """Returns whatever is still held back (incomplete characters included) once generation ends."""
        if not self.stopped:
            self._append(self._decode_new(final=True))
        return self._take(final=True)

    def _decode_new(self, final: bool) -> str:
        decode = self._tokenizer.decode
        known = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        window = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(window) <= len(known) or (window.endswith(_INCOMPLETE) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(known) :]

    def _append(self, piece: str) -> None:
        if not piece:
            return
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        matches = [i for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if matches:
            self.text = self.text[: min(matches)]
            self.stopped = True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        piece = self.text[self._emitted : end]
        self._emitted = end
        return piece
