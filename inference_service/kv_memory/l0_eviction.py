"""L0's eviction order, pure: leaves of the prefix tree first, among them the daemon's LFU with decay."""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

# Frequencies halve after this long without a hit: the daemon's default (cache_daemon/config.py, --half-life).
DEFAULT_HALF_LIFE_S = 3600.0


@dataclass(slots=True, frozen=True)
class L0Entry:
    """What eviction needs of a chunk L0 holds (its K/V live elsewhere)."""

    size_bytes: int
    parent: bytes | None  # the prefix key it chains from; None: a prompt's first chunk (it chains from the namespace)
    frequency: float = 1.0  # hits, decayed (see record_hit); a chunk counts once when it enters
    last_access: float = 0.0  # the clock's seconds at its last hit or entry

    def __post_init__(self) -> None:
        assert self.size_bytes > 0, f"size_bytes must be positive, got {self.size_bytes}"


def record_hit(entry: L0Entry, now: float, half_life: float) -> L0Entry:
    """The entry after one hit at `now`: its frequency decayed to now, plus one (cache_daemon.eviction.record_hits)."""
    elapsed = max(0.0, now - entry.last_access)
    frequency = entry.frequency * 2.0 ** (-elapsed / half_life) + 1
    return dataclasses.replace(entry, frequency=frequency, last_access=max(now, entry.last_access))


def retention_score(entry: L0Entry, half_life: float, orphan: bool = False) -> float:
    """log2 of the decayed frequency at any common moment, up to a constant: comparing it orders entries as their
    decayed frequencies would (cache_daemon.eviction.retention_score). An orphan scores lowest of all."""
    return -math.inf if orphan else math.log2(entry.frequency) + entry.last_access / half_life


# Whether another service tier holds a key (L0 for the host tier, the host tier for L0): a chunk whose parent is
# there is placed from the two together, so it is no orphan.
HeldElsewhere = Callable[[bytes], bool]


def is_orphan(entry: L0Entry, entries: Mapping[bytes, L0Entry], held_elsewhere: HeldElsewhere | None = None) -> bool:
    """Its parent is not held (here, or by held_elsewhere's tier): a prefix is placed from its first chunk, so this
    one cannot be placed until its parent comes back (fetched again)."""
    return (entry.parent is not None and entry.parent not in entries
            and (held_elsewhere is None or not held_elsewhere(entry.parent)))


def iter_eviction_order(entries: Mapping[bytes, L0Entry], half_life: float, keep: frozenset[bytes] = frozenset(),
                        held_elsewhere: HeldElsewhere | None = None) -> Iterator[bytes]:
    """Keys, the first to evict first; `keep`'s keys are never yielded.

    Only a leaf is a candidate: a chunk no held chunk chains from. A prefix is placed from its first chunk up to the
    first missing one, so a chunk whose parent left could never be placed again: evicting leaf first never strands
    one. Among leaves, orphans first (is_orphan), then the lowest retention score (frequency weighed with recency),
    then the least recently used, then the key. Evicting a leaf may make its parent one; a kept key keeps its
    ancestors too.
    """
    children = Counter(entry.parent for entry in entries.values() if entry.parent is not None)
    heap = [(retention_score(entry, half_life, is_orphan(entry, entries, held_elsewhere)), entry.last_access, key)
            for key, entry in entries.items() if not children[key] and key not in keep]
    heapq.heapify(heap)
    while heap:
        key = heapq.heappop(heap)[2]
        yield key
        parent = entries[key].parent
        if parent is None or parent not in entries:
            continue
        children[parent] -= 1
        if not children[parent] and parent not in keep:
            entry = entries[parent]
            heapq.heappush(heap, (retention_score(entry, half_life), entry.last_access, parent))


def eviction_order(entries: Mapping[bytes, L0Entry], half_life: float,
                   keep: frozenset[bytes] = frozenset()) -> list[bytes]:
    return list(iter_eviction_order(entries, half_life, keep))


def plan_admission(entries: Mapping[bytes, L0Entry], key: bytes, incoming: L0Entry, max_bytes: int,
                   half_life: float, held_elsewhere: HeldElsewhere | None = None) -> list[bytes] | None:
    """The held chunks to evict so that `incoming` (under `key`, not held yet) fits within max_bytes; None: it is
    not kept (larger than the tier, only its own ancestors could make room for it, which would strand it, or an
    orphan, kept only where there is room: nothing is evicted for what cannot be placed).

    A new chunk is admitted over held ones, as the daemon admits a Store (cache_daemon.eviction.plan_admission):
    the victims come in eviction order, computed as if it were held already, so its ancestors are not leaves.
    A prompt longer than the tier therefore keeps its first chunks and drops the rest as they come.
    """
    held = sum(entry.size_bytes for entry in entries.values())
    to_free = held + incoming.size_bytes - max_bytes
    if incoming.size_bytes > max_bytes:
        return None
    victims: list[bytes] = []
    if to_free <= 0:
        return victims
    if is_orphan(incoming, entries, held_elsewhere):
        return None
    freed = 0
    for victim in iter_eviction_order({**entries, key: incoming}, half_life, frozenset((key,)), held_elsewhere):
        victims.append(victim)
        freed += entries[victim].size_bytes
        if freed >= to_free:
            return victims
    return None
