"""Splits token streams (whole prompts or segments) into fixed-size chunks plus an unstored tail."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(slots=True, frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    start: int  # position of the first token in the whole prompt
    segment: int  # index of the segment the chunk belongs to

    def __post_init__(self) -> None:
        assert self.token_ids, "a chunk holds at least one token"
        assert self.start >= 0, f"chunk start must be >= 0, got {self.start}"

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(slots=True, frozen=True)
class ChunkPlan:
    chunks: tuple[Chunk, ...]  # stored and looked up, in prompt order
    tail: tuple[int, ...]  # tokens after the last chunk: always prefilled, never stored
    num_tokens: int

    @property
    def tail_start(self) -> int:
        return self.num_tokens - len(self.tail)

    @property
    def num_chunk_tokens(self) -> int:
        return self.num_tokens - len(self.tail)


def find_cuts(
    num_tokens: int,
    chunk_size: int,
    boundary_window: int = 0,
    is_boundary: Callable[[int], bool] | None = None,
) -> list[int]:
    """End offsets of the full chunks of a stream of num_tokens tokens.

    With boundary_window w > 0, each cut may slide up to w tokens either way to land right
    after a token index i for which is_boundary(i) holds (a sentence end); the nearest such
    place wins, ties going to the earlier cut. A cut never leaves a chunk empty.
    """
    assert chunk_size > 0, f"chunk_size must be positive, got {chunk_size}"
    assert boundary_window >= 0, f"boundary_window must be >= 0, got {boundary_window}"
    cuts: list[int] = []
    last = 0
    while last + chunk_size <= num_tokens:
        target = last + chunk_size
        cut = target
        if boundary_window and is_boundary is not None:
            cut = _nearest_boundary(target, last, num_tokens, boundary_window, is_boundary)
        cuts.append(cut)
        last = cut
    return cuts


def _nearest_boundary(target: int, last: int, num_tokens: int, window: int, is_boundary: Callable[[int], bool]) -> int:
    for distance in range(window + 1):
        for cut in (target - distance, target + distance):
            if last < cut <= num_tokens and is_boundary(cut - 1):
                return cut
    return target


def plan_chunks(
    token_ids: Sequence[int],
    chunk_size: int,
    boundary_window: int = 0,
    is_boundary: Callable[[int], bool] | None = None,
) -> ChunkPlan:
    """One segment: full chunks only, the rest is the tail."""
    return plan_segments([token_ids], chunk_size, boundary_window, is_boundary)


def plan_segments(
    segments: Sequence[Sequence[int]],
    chunk_size: int,
    boundary_window: int = 0,
    is_boundary: Callable[[int], bool] | None = None,
) -> ChunkPlan:
    """Chunks every segment from its own start.

    A segment's partial last chunk is a chunk of its own (so a document has the same chunks
    wherever it appears), except in the last segment, where it is the tail.
    """
    chunks: list[Chunk] = []
    offset = 0
    tail: tuple[int, ...] = ()
    for index, segment in enumerate(segments):
        ids = segment if type(segment) is tuple else tuple(segment)  # slices of a tuple are C copies, not loops
        boundary = None if is_boundary is None else (lambda i, ids=ids: is_boundary(ids[i]))
        cuts = find_cuts(len(ids), chunk_size, boundary_window, boundary)
        last = 0
        for cut in cuts:
            chunks.append(Chunk(ids[last:cut], offset + last, index))
            last = cut
        rest = ids[last:]
        if index == len(segments) - 1:
            tail = rest
        elif rest:
            chunks.append(Chunk(rest, offset + last, index))
        offset += len(ids)
    return ChunkPlan(tuple(chunks), tail, offset)
