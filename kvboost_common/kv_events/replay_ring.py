"""The last batches published, by sequence number, for a subscriber that missed some (pure, bounded)."""
from __future__ import annotations

from collections import deque


class ReplayRing:
    """Up to `capacity` (sequence, payload) pairs, oldest dropped first; sequences must rise by one."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0, f"capacity must be positive, got {capacity}"
        self._entries: deque[tuple[int, bytes]] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, sequence: int, payload: bytes) -> None:
        if self._entries:
            last = self._entries[-1][0]
            assert sequence == last + 1, f"sequence {sequence} does not follow {last}"
        self._entries.append((sequence, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """The kept batches whose sequence is start or later, oldest first (those already dropped are gone)."""
        if not self._entries or start > self._entries[-1][0]:
            return []
        first = self._entries[0][0]
        return list(self._entries)[max(0, start - first):]
