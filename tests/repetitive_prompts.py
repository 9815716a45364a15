"""Hypothesis strategies of prompts built from repeated pieces, and the orders they are asked in.

What breaks a chunk cache that reuses by content: the same chunk of tokens at many places. These prompts are made
of it: one word over and over, log lines, CSV rows, a document repeated inside a prompt or shared by two, chat turns
that repeat, prompts that are prefixes of each other, and unicode whose bytes split across chunk boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

WORDS = ("hi ", "ok ", "the ", "0 ", "é ", "日本 ", "🙂 ", "ab")
LINES = (
    "2026-11-26 12:00:01 ERROR disk /dev/vda1 is full\n",
    "GET /index.html 200 512\n",
    "id,name,qty\n",
    "7,bolt,100\n",
    "| a | b | c |\n",
)
# Document text: ASCII, accented and CJK letters and an emoji, so multi-byte characters cross chunk boundaries.
DOCUMENT_ALPHABET = st.sampled_from(list("abcdefgh ijk.,\n") + ["é", "ü", "日", "本", "🙂"])


@st.composite
def documents(draw, max_size: int = 40) -> str:
    return draw(st.text(DOCUMENT_ALPHABET, min_size=4, max_size=max_size))


@st.composite
def repeated_piece(draw, max_repeats: int = 24) -> str:
    """One piece (a word, a log or CSV line, a short document) repeated 1..max_repeats times."""
    piece = draw(st.one_of(st.sampled_from(WORDS), st.sampled_from(LINES), documents(max_size=24)))
    return piece * draw(st.integers(1, max_repeats))


@st.composite
def repetitive_prompts(draw, max_pieces: int = 4, max_chars: int = 360) -> str:
    """A prompt of a few repeated pieces (maybe with a short distinct lead), at most max_chars characters."""
    lead = draw(st.sampled_from(["", "0 ", "3 ", "Q: ", "日 "]))
    body = "".join(draw(st.lists(repeated_piece(), min_size=1, max_size=max_pieces)))
    return (lead + body)[:max_chars] or "hi"


@dataclass(frozen=True)
class Workload:
    """Distinct prompts and the order they are asked in (indices; repeats ask a prompt again)."""

    prompts: tuple[str, ...]
    order: tuple[int, ...]

    def asked(self) -> list[str]:
        return [self.prompts[index] for index in self.order]


@st.composite
def workloads(draw, max_prompts: int = 4, max_asks: int = 6, max_chars: int = 360) -> Workload:
    """A few repetitive prompts, some derived from others (a prefix of one, one continued, a document shared),
    asked in a generated order with repeats."""
    first = draw(repetitive_prompts(max_chars=max_chars))
    prompts = [first]
    for _ in range(draw(st.integers(1, max_prompts - 1))):
        base = draw(st.sampled_from(prompts))
        kind = draw(st.sampled_from(["new", "prefix", "continued", "other_lead", "doubled"]))
        if kind == "new":
            prompt = draw(repetitive_prompts(max_chars=max_chars))
        elif kind == "prefix":
            prompt = base[: draw(st.integers(1, len(base)))]
        elif kind == "continued":
            prompt = (base + draw(repeated_piece()))[:max_chars]
        elif kind == "other_lead":  # the same body after another first token: content hits, never prefix hits
            prompt = draw(st.sampled_from(["1 ", "2 ", "x", "Q: "])) + base
        else:  # a document repeated inside one prompt
            prompt = (base + base)[:max_chars]
        prompts.append(prompt[:max_chars] or "hi")
    order = draw(st.lists(st.integers(0, len(prompts) - 1), min_size=len(prompts), max_size=max_asks))
    # Every prompt is asked at least once; the generated order decides where.
    order = order + [index for index in range(len(prompts)) if index not in order]
    return Workload(tuple(prompts), tuple(order))


@st.composite
def chat_workloads(draw, max_turns: int = 3) -> list[list[dict[str, str]]]:
    """Conversations whose turns repeat pieces: each later conversation continues or restarts an earlier one."""
    system = "You answer from the notes. " + draw(repeated_piece(max_repeats=8))
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": draw(repeated_piece())}]]
    for _ in range(draw(st.integers(1, max_turns))):
        base = draw(st.sampled_from(conversations))
        if draw(st.booleans()):  # the next turn of that conversation
            turn = [{"role": "assistant", "content": draw(repeated_piece(max_repeats=4))},
                    {"role": "user", "content": draw(repeated_piece())}]
            conversations.append(base + turn)
        else:  # the same system prompt, another question
            conversations.append(base[:1] + [{"role": "user", "content": draw(repeated_piece())}])
    return conversations
