"""Turns a request's prompt, chat messages or segments into token ids, chunks and chunk keys."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from inference_service.kv.chunking import ChunkPlan, plan_segments
from inference_service.kv.chunk_keys import ContentKey, PrefixKey, content_key, prefix_keys
from inference_service.kv.namespace import Namespace


@dataclass(slots=True, frozen=True)
class PromptPlan:
    token_ids: tuple[int, ...]  # the whole prompt
    chunks: ChunkPlan
    prefix_keys: tuple[PrefixKey, ...]  # one per chunk
    content_keys: tuple[ContentKey, ...]  # one per chunk

    def __post_init__(self) -> None:
        assert len(self.prefix_keys) == len(self.content_keys) == len(self.chunks.chunks), "one key of each kind per chunk"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def tokenize_prompt(tokenizer, prompt: str) -> list[list[int]]:
    """Raw text, tokenized as is (special tokens as the tokenizer adds them)."""
    return [list(tokenizer(prompt)["input_ids"])]


def tokenize_messages(tokenizer, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> list[list[int]]:
    """Chat messages through the tokenizer's chat template."""
    conversation = [{"role": role, "content": content} for role, content in messages]
    encoded = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return [list(encoded["input_ids"])]


def tokenize_segments(tokenizer, segments: Sequence[str]) -> list[list[int]]:
    """Each segment alone; only the first gets the tokenizer's special tokens."""
    return [list(tokenizer(text, add_special_tokens=index == 0)["input_ids"]) for index, text in enumerate(segments)]


def tokenize_document(tokenizer, text: str) -> list[list[int]]:
    """A document as it appears as a later, not final, segment: alone, without special tokens, followed
    by an empty segment so its partial last chunk is a chunk (stored and content-keyed) as it is there."""
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]), []]


def plan_prompt(namespace: Namespace, segments: Sequence[Sequence[int]], chunk_size: int) -> PromptPlan:
    """Chunks every segment from its own start and keys every chunk (prefix chain and content)."""
    chunks = plan_segments(segments, chunk_size)
    chunk_ids = [chunk.token_ids for chunk in chunks.chunks]
    return PromptPlan(
        token_ids=tuple(token for segment in segments for token in segment),
        chunks=chunks,
        prefix_keys=tuple(prefix_keys(namespace, chunk_ids)),
        content_keys=tuple(content_key(namespace, ids) for ids in chunk_ids),
    )
