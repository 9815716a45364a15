"""Chunks a tier holds, as vLLM blocks: the blocks of block_size tokens that lie wholly inside the contiguous run of
held chunks that starts at position 0, with BlockStored / BlockRemoved events as that run grows and shrinks (pure).

A chunk is connected when it starts at 0, or its parent is held and connected: only a connected chunk's tokens are
an exactly-cached prefix. Block j covers tokens [j*block_size, (j+1)*block_size) and belongs to the chunk that holds
its last token; a block that straddles two chunks needs both. Block hashes chain over the token ids from a seed (the
engine's namespace), so one block has one hash whichever chunk (a whole chunk, or a prompt's tail kept as a partial
chunk) brings it, and every restart computes the same ones; a block shared by two held chunks is counted twice and
leaves with the last of them.
"""
from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass

from kvboost_common.kv_events.wire import block_removed, block_stored

# vLLM's consumers read a block hash as a 64-bit integer, some as signed, some as unsigned: 63 bits suit both.
HASH_MASK = (1 << 63) - 1
DEFAULT_MAX_NOTED = 1 << 14  # chunks of recent plans (2M tokens at 128 a chunk)


def block_hash(parent: int | None, token_ids: tuple[int, ...], seed: bytes) -> int:
    """SHA-256 over the parent's hash (8 bytes, big-endian; the seed for a prompt's first block) and the token ids
    (4 bytes each, little-endian), cut to 63 bits."""
    digest = hashlib.sha256(seed if parent is None else parent.to_bytes(8, "big"))
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(digest.digest()[:8], "big") & HASH_MASK


@dataclass(slots=True, frozen=True)
class ChunkTokens:
    """What a prompt's plan says of one chunk: its first position, token ids, and the key it chains from."""

    start: int
    token_ids: tuple[int, ...]
    parent: bytes | None  # None: the prompt's first chunk (start 0)

    def __post_init__(self) -> None:
        assert self.token_ids, "a chunk has tokens"
        assert (self.parent is None) == (self.start == 0), "only the chunk at position 0 has no parent"


@dataclass(slots=True)
class _Connected:
    blocks: list[int]  # hashes of the blocks this chunk owns (their last token is its)
    last_hash: int | None  # the hash of the last block ending at or before its end; None: no block yet
    carry: tuple[int, ...]  # its tokens after the last block boundary (the start of the next block)


class BlockGrid:
    """The blocks of one tier (medium) that a publisher announces, from the chunks that enter and leave it."""

    def __init__(self, block_size: int, seed: bytes, medium: str, max_noted: int = DEFAULT_MAX_NOTED) -> None:
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        assert max_noted > 0, f"max_noted must be positive, got {max_noted}"
        self.block_size = block_size
        self.seed = seed
        self.medium = medium
        self._max_noted = max_noted
        self._noted: OrderedDict[bytes, ChunkTokens] = OrderedDict()  # recent plans' chunks, least recent first
        self._held: dict[bytes, ChunkTokens] = {}  # in the tier, with known tokens
        self._children: dict[bytes, set[bytes]] = {}  # held chunks by the key they chain from
        self._connected: dict[bytes, _Connected] = {}
        self._references: Counter[int] = Counter()  # announced blocks, by how many connected chunks own each

    @property
    def num_blocks(self) -> int:
        """Blocks announced and not removed."""
        return len(self._references)

    def note(self, key: bytes, chunk: ChunkTokens) -> None:
        """Remembers a chunk's tokens (a plan's), for when the tier takes it; the oldest notes go past max_noted."""
        self._noted[key] = chunk
        self._noted.move_to_end(key)
        while len(self._noted) > self._max_noted:
            self._noted.popitem(last=False)

    def add(self, key: bytes) -> list[dict]:
        """The tier took the chunk: the events for the blocks that joined the connected run (none when its tokens
        were never noted: it is not announced, nor is anything that chains from it)."""
        chunk = self._held.get(key) or self._noted.get(key)
        if chunk is None or key in self._held:
            return []
        self._held[key] = chunk
        if chunk.parent is not None:
            self._children.setdefault(chunk.parent, set()).add(key)
        if chunk.parent is not None and chunk.parent not in self._connected:
            return []
        return self._connect(key)

    def remove(self, key: bytes) -> list[dict]:
        """The tier let the chunk go: the events for the blocks that left the connected run with it (its own,
        and those of every chunk that chained from it, which stay held but no longer start at position 0)."""
        chunk = self._held.pop(key, None)
        if chunk is None:
            return []
        removed = self._disconnect(key) if key in self._connected else []
        if chunk.parent is not None:
            siblings = self._children.get(chunk.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[chunk.parent]
        return [block_removed(removed, self.medium)] if removed else []

    def clear(self) -> None:
        """Forgets every held chunk (the tier was emptied; the caller announces AllBlocksCleared)."""
        self._held.clear()
        self._children.clear()
        self._connected.clear()
        self._references.clear()

    def _connect(self, key: bytes) -> list[dict]:
        events: list[dict] = []
        stack = [key]
        while stack:  # parents before children: a block's parent is announced before it
            current = stack.pop()
            events += self._connect_one(current)
            stack.extend(sorted(self._children.get(current, ())))
        return events

    def _connect_one(self, key: bytes) -> list[dict]:
        chunk = self._held[key]
        parent = self._connected[chunk.parent] if chunk.parent is not None else None
        previous = parent.last_hash if parent is not None else None
        pending = (parent.carry if parent is not None else ()) + chunk.token_ids
        size = self.block_size
        blocks, events, run, run_parent = [], [], [], previous
        for offset in range(0, len(pending) - size + 1, size):
            tokens = pending[offset : offset + size]
            current = block_hash(previous, tokens, self.seed)
            blocks.append(current)
            self._references[current] += 1
            if self._references[current] == 1:
                run.append((current, tokens))
            else:  # already announced (another chunk owns it too): the run of new blocks ends here
                events += self._stored(run, run_parent)
                run, run_parent = [], current
            previous = current
        events += self._stored(run, run_parent)
        whole = len(pending) - len(pending) % size
        self._connected[key] = _Connected(blocks, previous, pending[whole:])
        return events

    def _stored(self, run: list[tuple[int, tuple[int, ...]]], parent: int | None) -> list[dict]:
        if not run:
            return []
        tokens = [token for _, block_tokens in run for token in block_tokens]
        return [block_stored([current for current, _ in run], parent, tokens, self.block_size, self.medium)]

    def _disconnect(self, key: bytes) -> list[int]:
        """Hashes whose last owner left, children's blocks before their parents'."""
        removed: list[int] = []
        for child in sorted(self._children.get(key, ())):
            if child in self._connected:
                removed += self._disconnect(child)
        for current in reversed(self._connected.pop(key).blocks):
            self._references[current] -= 1
            if not self._references[current]:
                del self._references[current]
                removed.append(current)
        return removed
