"""An indexed binary min-heap of slots, ordered exactly as eviction.iter_eviction_order orders entries."""
from __future__ import annotations

import heapq
from array import array
from typing import Iterator

import numpy as np

from cache_daemon.entry import DIGEST_SIZE

NOT_IN_HEAP = -1


class SlotHeap:
    """Slots ordered by (score, last_access, key), the first to evict on top; pure, no locking.

    It reads the three columns it is given (owned by the index, indexed by slot) and keeps
    `_positions[slot]` = where the slot sits in `_heap`, so removing or re-ranking any slot
    costs O(log n) and finding the next victims costs O(k log k) for k of them, whatever n is.
    A slot's columns must not change while it is in the heap: remove it first, or call
    `update` right after the change.
    """

    def __init__(self, scores: array, last_accesses: array, keys: bytearray) -> None:
        self._scores = scores  # 'd' [capacity]
        self._last_accesses = last_accesses  # 'd' [capacity]
        self._keys = keys  # [capacity * 32]
        self._heap = array("i")  # slots; _heap[i] ranks before _heap[2i+1] and _heap[2i+2]
        self._positions = array("i")  # [capacity]: index into _heap, NOT_IN_HEAP when absent

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, slot: int) -> bool:
        return slot < len(self._positions) and self._positions[slot] != NOT_IN_HEAP

    def grow(self, capacity: int) -> None:
        if capacity > len(self._positions):
            self._positions.extend(array("i", [NOT_IN_HEAP]) * (capacity - len(self._positions)))

    def push(self, slot: int) -> None:
        assert slot not in self, f"slot {slot} is already in the heap"
        self._heap.append(slot)
        self._positions[slot] = len(self._heap) - 1
        self._sift_up(len(self._heap) - 1)

    def remove(self, slot: int) -> None:
        index = self._positions[slot]
        assert index != NOT_IN_HEAP, f"slot {slot} is not in the heap"
        self._positions[slot] = NOT_IN_HEAP
        last = self._heap.pop()
        if index == len(self._heap):
            return
        self._heap[index] = last
        self._positions[last] = index
        self._sift_up(index)
        self._sift_down(self._positions[last])

    def update(self, slot: int) -> None:
        """Re-ranks a slot whose score or last access just changed."""
        index = self._positions[slot]
        assert index != NOT_IN_HEAP, f"slot {slot} is not in the heap"
        self._sift_up(index)
        self._sift_down(self._positions[slot])

    def replace_all(self, ordered_slots: np.ndarray) -> None:
        """Takes slots already sorted by rank (a sorted array is a heap): the O(n log n) bulk load
        runs vectorized in the caller instead of n pushes here."""
        positions = np.frombuffer(self._positions, dtype=np.int32)
        positions[np.frombuffer(self._heap, dtype=np.int32)] = NOT_IN_HEAP
        positions[ordered_slots] = np.arange(len(ordered_slots), dtype=np.int32)
        del positions  # a live view would pin the array's size
        self._heap = array("i", np.asarray(ordered_slots, dtype=np.int32).tobytes())

    def iter_in_order(self) -> Iterator[int]:
        """Slots from the first to evict on, without changing the heap: a small side heap holds the
        frontier (children of what was yielded), so k slots cost O(k log k)."""
        if not self._heap:
            return
        frontier = [self._rank(0)]
        while frontier:
            *_, index = heapq.heappop(frontier)
            yield self._heap[index]
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(self._heap):
                    heapq.heappush(frontier, self._rank(child))

    def _rank(self, index: int) -> tuple[float, float, bytes, int]:
        slot = self._heap[index]
        return self._scores[slot], self._last_accesses[slot], self._key(slot), index

    def _key(self, slot: int) -> bytes:
        return bytes(self._keys[slot * DIGEST_SIZE:(slot + 1) * DIGEST_SIZE])

    def _less(self, a: int, b: int) -> bool:
        score_a, score_b = self._scores[a], self._scores[b]
        if score_a != score_b:
            return score_a < score_b
        last_a, last_b = self._last_accesses[a], self._last_accesses[b]
        if last_a != last_b:
            return last_a < last_b
        return self._key(a) < self._key(b)

    def _sift_up(self, index: int) -> None:
        heap, positions = self._heap, self._positions
        slot = heap[index]
        while index > 0:
            parent = (index - 1) >> 1
            parent_slot = heap[parent]
            if not self._less(slot, parent_slot):
                break
            heap[index] = parent_slot
            positions[parent_slot] = index
            index = parent
        heap[index] = slot
        positions[slot] = index

    def _sift_down(self, index: int) -> None:
        heap, positions = self._heap, self._positions
        size = len(heap)
        slot = heap[index]
        while True:
            child = 2 * index + 1
            if child >= size:
                break
            if child + 1 < size and self._less(heap[child + 1], heap[child]):
                child += 1
            child_slot = heap[child]
            if not self._less(child_slot, slot):
                break
            heap[index] = child_slot
            positions[child_slot] = index
            index = child
        heap[index] = slot
        positions[slot] = index
