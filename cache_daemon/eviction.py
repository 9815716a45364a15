"""Eviction policy, pure: LFU with exponential decay (aging), ties broken by last access."""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence, TypeVar

from cache_daemon.entry import ChunkKey, Entry

# half_life is in seconds; math.inf turns decay off (plain LFU).
NO_DECAY = math.inf
K = TypeVar("K")  # what identifies a stored chunk to the caller: its key, or its slot in the index


def decayed_frequency(entry: Entry, now: float, half_life: float) -> float:
    """The entry's hit count as of `now`: it halves every `half_life` seconds without a hit."""
    elapsed = max(0.0, now - entry.last_access)
    return entry.frequency * 2.0 ** (-elapsed / half_life)


def record_hits(entry: Entry, num_hits: int, now: float, half_life: float) -> Entry:
    """The entry after `num_hits` hits at `now` (hits batched within one flush share one time)."""
    frequency = decayed_frequency(entry, now, half_life) + num_hits
    return dataclasses.replace(entry, frequency=frequency, last_access=max(now, entry.last_access))


def retention_score(entry: Entry, half_life: float) -> float:
    """log2 of the decayed frequency at any common `now`, minus log2 of 2**(now/half_life).

    Decay multiplies every entry by the same factor as time passes, so comparing
    log2(frequency) + last_access / half_life orders entries exactly as comparing their
    decayed frequencies would at any single moment, without needing that moment.
    """
    if entry.frequency <= 0:
        return -math.inf
    return math.log2(entry.frequency) + entry.last_access / half_life


def iter_eviction_order(entries: Mapping[ChunkKey, Entry], half_life: float) -> Iterator[ChunkKey]:
    """Unpinned keys, the first to evict first: lowest score, then least recently used, then key."""
    heap = [
        (retention_score(entry, half_life), entry.last_access, key)
        for key, entry in entries.items()
        if not entry.pinned
    ]
    heapq.heapify(heap)
    while heap:
        yield heapq.heappop(heap)[2]


def eviction_order(entries: Mapping[ChunkKey, Entry], half_life: float) -> list[ChunkKey]:
    return list(iter_eviction_order(entries, half_life))


@dataclass(slots=True, frozen=True)
class AdmissionPlan:
    """Which incoming chunks to write and which stored chunks to evict for them."""

    admitted: list[ChunkKey]  # in arrival order
    rejected: list[ChunkKey]  # did not fit beside the pinned chunks
    victims: list  # stored chunks to delete (keys, or the candidates' ids), in eviction order
    bytes_freed: int


def plan_admission(
    entries: Mapping[ChunkKey, Entry],
    incoming: Sequence[tuple[ChunkKey, int]],
    max_bytes: int,
    half_life: float,
) -> AdmissionPlan:
    """The exact reference over a mapping of every entry: O(n) per call. The daemon calls
    plan_admission_from_totals with counters and its heap instead (index.EntryIndex)."""
    stored_bytes = sum(entry.size_bytes for entry in entries.values())
    pinned_bytes = sum(entry.size_bytes for entry in entries.values() if entry.pinned)
    candidates = ((key, entries[key].size_bytes) for key in iter_eviction_order(entries, half_life))
    return plan_admission_from_totals(stored_bytes, pinned_bytes, candidates, incoming, max_bytes)


def plan_admission_from_totals(
    stored_bytes: int,
    pinned_bytes: int,
    candidates: Iterator[tuple[K, int]],
    incoming: Sequence[tuple[ChunkKey, int]],
    max_bytes: int,
) -> AdmissionPlan:
    """Admit incoming (key, size) in order while they fit beside the pinned chunks, then evict.

    New chunks are always admitted over stored unpinned ones; the first incoming chunk that
    does not fit ends admission, so a prefix chain is kept from its start. Afterwards the
    stored bytes plus the admitted bytes are at most `max_bytes`. `candidates` yields the
    unpinned stored chunks as (id, size), the first to evict first; it is read only as far
    as the bytes to free, so its cost is that of the victims, not of the cache.
    """
    room = max_bytes - pinned_bytes
    admitted: list[ChunkKey] = []
    admitted_bytes = 0
    for index, (key, size_bytes) in enumerate(incoming):
        if admitted_bytes + size_bytes > room:
            rejected = [key for key, _ in incoming[index:]]
            break
        admitted.append(key)
        admitted_bytes += size_bytes
    else:
        rejected = []

    bytes_to_free = stored_bytes + admitted_bytes - max_bytes
    victims: list = []
    bytes_freed = 0
    if bytes_to_free > 0:
        for victim, size_bytes in candidates:
            victims.append(victim)
            bytes_freed += size_bytes
            if bytes_freed >= bytes_to_free:
                break
    return AdmissionPlan(admitted=admitted, rejected=rejected, victims=victims, bytes_freed=bytes_freed)
