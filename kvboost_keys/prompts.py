"""Turns a request's prompt, chat messages or segments into token ids, chunks and chunk keys."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

from kvboost_keys.chunking import Chunk, ChunkPlan, plan_segments
from kvboost_keys.chunk_keys import (
    ContentKey, PrefixKey, encode_token_ids, hash_prefix_chunk, keys_of_packed, partial_prefix_keys,
)
from kvboost_keys.namespace import Namespace
from kvboost_keys.token_cache import TokenCache


@dataclass(slots=True, frozen=True)
class PromptPlan:
    token_ids: tuple[int, ...]  # the whole prompt
    chunks: ChunkPlan
    prefix_keys: tuple[PrefixKey, ...]  # one per chunk
    content_keys: tuple[ContentKey, ...]  # one per chunk
    # Prefix key of the tail stored as a partial chunk (hash_prefix_chunk(last prefix key, tail)); None
    # when the prompt ends on a chunk boundary.
    tail_key: PrefixKey | None = None
    namespace: bytes = b""  # seeds the chain: the parent of the first chunk
    packed_ids: bytes = b""  # token_ids as the keys hash them (encode_token_ids); empty: not kept

    def __post_init__(self) -> None:
        assert len(self.prefix_keys) == len(self.content_keys) == len(self.chunks.chunks), "one key of each kind per chunk"
        assert self.tail_key is None or self.chunks.tail, "a tail key needs a tail"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def parent_key(self, chunk_index: int) -> bytes:
        """The prefix key a chunk at chunk_index chains from: the previous chunk's, or the namespace."""
        return self.prefix_keys[chunk_index - 1] if chunk_index else self.namespace

    def partial_candidates(self, run: int) -> tuple[int, list[PrefixKey]]:
        """(start, keys) of the partial chunks that could extend a prefix run of `run` chunks: the keys of
        the first n tokens after the run, longest first, for every n shorter than the next chunk (or up to
        the whole tail when the run covers every chunk).

        A partial chunk is stored for the tail of a warmed text or of a written-back prompt; a prompt that
        continues that text reuses it to its last token. Exact: the key chains over every token before.
        """
        start, length = self.partial_span(run)
        if length <= 0:
            return start, []
        return start, partial_prefix_keys(self.parent_key(run), self.token_ids[start : start + length])

    def partial_span(self, run: int) -> tuple[int, int]:
        """(start, length) of the tokens a chunk continuing a run of `run` whole chunks may cover: chunk run's tokens
        but its last, or the tail after the last chunk."""
        chunks = self.chunks.chunks
        if run < len(chunks):
            return chunks[run].start, len(chunks[run].token_ids) - 1
        return self.chunks.tail_start, len(self.chunks.tail)

    def tokens_after_runs(self) -> tuple[bytes, ...]:
        """For r = 0..len(chunks): the packed ids of partial_span(r), the tokens one Lookup asks about for whichever
        run the daemon finds (AfterRun)."""
        packed = self.packed_ids or encode_token_ids(self.token_ids)
        spans = (self.partial_span(run) for run in range(len(self.chunks.chunks) + 1))
        return tuple(packed[4 * start : 4 * (start + max(length, 0))] for start, length in spans)

    def tail_chunk(self) -> Chunk | None:
        """The tail as a (partial) chunk to store under tail_key; None when the prompt has no tail."""
        if not self.chunks.tail:
            return None
        segment = self.chunks.chunks[-1].segment if self.chunks.chunks else 0
        return Chunk(self.chunks.tail, self.chunks.tail_start, segment)


def tokenize_prompt(tokenizer, prompt: str, cache: TokenCache | None = None, scope: bytes = b"") -> list[list[int]]:
    """Raw text, tokenized as is (special tokens as the tokenizer adds them)."""
    if cache is not None:
        return [cache.encode_text(prompt, scope)]
    return [list(tokenizer(prompt)["input_ids"])]


def tokenize_messages(tokenizer, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True,
                      cache: TokenCache | None = None, scope: bytes = b"") -> list[list[int]]:
    """Chat messages through the tokenizer's chat template."""
    conversation = [{"role": role, "content": content} for role, content in messages]
    if cache is not None:
        return [cache.encode_chat(conversation, scope, add_generation_prompt)]
    encoded = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return [list(encoded["input_ids"])]


def tokenize_segments(tokenizer, segments: Sequence[str], cache: TokenCache | None = None,
                      scope: bytes = b"") -> list[list[int]]:
    """Each segment alone; only the first gets the tokenizer's special tokens."""
    if cache is not None:
        return [cache.encode_text(text, scope, add_special_tokens=index == 0) for index, text in enumerate(segments)]
    return [list(tokenizer(text, add_special_tokens=index == 0)["input_ids"]) for index, text in enumerate(segments)]


def tokenize_document(tokenizer, text: str, cache: TokenCache | None = None, scope: bytes = b"") -> list[list[int]]:
    """A document as it appears as a later, not final, segment: alone, without special tokens, followed
    by an empty segment so its partial last chunk is a chunk (stored and content-keyed) as it is there."""
    if cache is not None:
        return [cache.encode_text(text, scope, add_special_tokens=False), []]
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]), []]


def tokenize_request(tokenizer, prompt: str | None, messages: Sequence[tuple[str, str]] | None,
                     segments: Sequence[str] | None, cache: TokenCache | None = None,
                     scope: bytes = b"") -> list[list[int]]:
    """A Generate request's segments as the service tokenizes them: the prompt as is, else the messages through
    the chat template (generation prompt added), else the segments. cache: known pieces of text under scope (the
    request's namespace) are not tokenized again (kvboost_keys.token_cache; the same ids)."""
    if prompt:
        return tokenize_prompt(tokenizer, prompt, cache, scope)
    if messages:
        return tokenize_messages(tokenizer, messages, True, cache, scope)
    return tokenize_segments(tokenizer, segments or (), cache, scope)


def tokenize_warm(tokenizer, text: str | None, messages: Sequence[tuple[str, str]] | None,
                  content_addressed: bool, cache: TokenCache | None = None, scope: bytes = b"") -> list[list[int]]:
    """A Warm request's segments: a chat prefix without the generation prompt, a document chunked as a later
    segment (content-addressed), or raw text. Raises ValueError when neither text nor messages are given."""
    if messages:
        return tokenize_messages(tokenizer, messages, False, cache, scope)
    if text and content_addressed:
        return tokenize_document(tokenizer, text, cache, scope)
    if text:
        return tokenize_prompt(tokenizer, text, cache, scope)
    raise ValueError("Warm needs text or messages")


def plan_prompt(namespace: Namespace, segments: Sequence[Sequence[int]], chunk_size: int) -> PromptPlan:
    """Chunks every segment from its own start and keys every chunk (prefix chain and content) and the tail.

    The prompt's ids are packed (and range-checked) once; every key hashes a slice of those bytes.
    Raises ValueError for a token id that does not fit in 4 bytes.
    """
    token_ids = tuple(chain.from_iterable(segments))
    packed = encode_token_ids(token_ids)
    chunks = plan_segments(segments, chunk_size)
    keys, contents = keys_of_packed(namespace, packed, [(chunk.start, chunk.end) for chunk in chunks.chunks])
    tail_key = None
    if chunks.tail:
        tail_key = hash_prefix_chunk(keys[-1] if keys else namespace, chunks.tail)
    return PromptPlan(
        token_ids=token_ids,
        chunks=chunks,
        prefix_keys=tuple(keys),
        content_keys=tuple(contents),
        tail_key=tail_key,
        namespace=namespace,
        packed_ids=packed,
    )
