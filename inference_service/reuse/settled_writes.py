"""The write-backs that ended, numbered, and whether one of them made a prompt's earlier Lookup out of date."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

from inference_service.store.protocol import StoreLookup
from kvboost_keys.chunk_keys import encode_token_ids
from kvboost_keys.prompts import PromptPlan

# Write-backs remembered; an answer asked before the oldest is asked again. Each holds its chunks' token ids packed
# (4 bytes a token: a 32k-token write-back, 128 KiB), so the log stays within tens of MiB.
DEFAULT_SETTLED_LOG_SIZE = 512


@dataclass(slots=True, frozen=True)
class SettledWrite:
    """What one write-back may have stored: its chunks' prefix keys, content keys, and each chunk's
    (parent key, token ids packed by encode_token_ids), which is what a continuation or partial-chunk query compares
    against."""

    prefix_keys: frozenset[bytes]
    content_keys: frozenset[bytes]
    children: tuple[tuple[bytes, bytes], ...]
    indexed: bool = True  # False: its chunks named no parent; it may have answered any query after a run

    @classmethod
    def of(cls, prefix_keys: Sequence[bytes], content_keys: Iterable[bytes | None], parent_keys: Sequence[bytes],
           token_ids: Sequence[Sequence[int]]) -> SettledWrite:
        """parent_keys: one per chunk, or () for chunks stored without a parent (not indexed under one)."""
        assert not parent_keys or len(parent_keys) == len(token_ids), "one parent key per chunk"
        return cls(frozenset(prefix_keys), frozenset(key for key in content_keys if key is not None),
                   tuple(zip(parent_keys, (encode_token_ids(ids) for ids in token_ids))), bool(parent_keys))


class SettledLog:
    """The last `capacity` write-backs that ended, in the order they ended. Thread-safe: the write-back thread
    adds, the step loop reads."""

    def __init__(self, capacity: int = DEFAULT_SETTLED_LOG_SIZE) -> None:
        assert capacity > 0, f"capacity must be positive, got {capacity}"
        self._writes: deque[SettledWrite] = deque(maxlen=capacity)
        self._num_settled = 0
        self._lock = threading.Lock()

    @property
    def num_settled(self) -> int:
        """Write-backs ended so far: the mark an answer asked now is compared from."""
        return self._num_settled

    def add(self, write: SettledWrite) -> None:
        with self._lock:
            self._writes.append(write)
            self._num_settled += 1

    def since(self, mark: int) -> list[SettledWrite] | None:
        """The write-backs that ended after `mark` (a num_settled read earlier); None when some were forgotten."""
        with self._lock:
            first_kept = self._num_settled - len(self._writes)
            if mark < first_kept:
                return None
            return list(self._writes)[mark - first_kept:]


def overtakes(write: SettledWrite, prompt: PromptPlan, lookup: StoreLookup, with_content_hits: bool) -> bool:
    """Whether the write-back may have stored something `lookup` (the prompt's Lookup, asked before it ended) would
    have found: one of the prompt's chunks after the run it found, a content hit for one of them (when the Lookup
    asked for content hits), or a chunk chained from the run's last key that shares more leading tokens with the
    prompt's next tokens than the partial chunk or continuation the Lookup found."""
    run = lookup.prefix_run
    if not write.indexed:
        return True
    if write.prefix_keys and not write.prefix_keys.isdisjoint(prompt.prefix_keys[run:]):
        return True
    if with_content_hits and write.content_keys:
        missing = (key for index, key in enumerate(prompt.content_keys[run:], start=run)
                   if index not in lookup.content_hits)
        if not write.content_keys.isdisjoint(missing):
            return True
    start, length = prompt.partial_span(run)
    if length <= 0:
        return False
    parent = prompt.parent_key(run)
    candidates = [packed for chunk_parent, packed in write.children if chunk_parent == parent]
    if not candidates:
        return False
    after_run = (prompt.packed_ids or encode_token_ids(prompt.token_ids))[4 * start : 4 * (start + length)]
    found = max(lookup.partial_tokens, lookup.continuation_tokens)
    return any(shared_tokens(after_run, packed) > found for packed in candidates)


def shared_tokens(packed: bytes, other: bytes) -> int:
    """How many leading token ids two encode_token_ids byte strings share."""
    low, high = 0, min(len(packed), len(other)) // 4  # the answer lies in [low, high]
    while low < high:  # bytes compare in C: log(n) slices, not a Python loop per token
        middle = (low + high + 1) // 2
        if packed[: 4 * middle] == other[: 4 * middle]:
            low = middle
        else:
            high = middle - 1
    return low


def still_current(log: SettledLog, mark: int, prompt: PromptPlan, lookup: StoreLookup,
                  with_content_hits: bool) -> bool:
    """Whether no write-back that ended after `mark` overtook `lookup` (see overtakes)."""
    writes = log.since(mark)
    return writes is not None and not any(overtakes(write, prompt, lookup, with_content_hits) for write in writes)
