"""What the daemon keeps of each stored chunk in RAM: compact per-slot columns, byte totals as counters."""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np

from cache_daemon.entry import DIGEST_SIZE, ChunkKey, Entry
from cache_daemon.eviction import retention_score
from cache_daemon.priority import SlotHeap

LIVE = 1
PINNED = 2
_MIN_GROWTH = 1024


@dataclass(slots=True)
class NamespaceUsage:
    num_entries: int = 0
    num_bytes: int = 0
    num_pinned: int = 0


@dataclass(slots=True, eq=False)
class Share:
    """One tenant's part of the budget: its byte totals and an eviction heap over its own slots only."""

    tenant: str
    max_bytes: int
    heap: SlotHeap
    num_bytes: int = 0
    pinned_bytes: int = 0


class EntryIndex:
    """Slot -> (key, size, frequency, last access, score, flags, namespace) for every committed
    chunk, in typed arrays (~80 bytes per slot), with the eviction heap over them. The slot of a
    chunk is stored in its LMDB metadata, so this index needs no key -> slot map: callers read
    the slot from the store. No locking (the cache serializes writers).

    Invariants: `flags[s] & LIVE` for exactly the slots of stored chunks; the heap holds exactly
    the live unpinned slots; num_entries, num_bytes, pinned_bytes and the namespace usages are
    the sums over live slots, kept by every change (never recomputed by a sum over entries).

    Tenant shares: a namespace owned by a tenant with a budget of its own (`share_budgets`,
    tenant -> max_bytes) puts its slots in that tenant's Share too, whose heap holds exactly the
    tenant's live unpinned slots and whose totals are the sums over its live slots.
    """

    def __init__(self, half_life: float, share_budgets: Mapping[str, int] | None = None) -> None:
        self.half_life = half_life
        self.keys = bytearray()  # [capacity * 32]
        self.sizes = array("q")  # blob bytes
        self.frequencies = array("d")
        self.last_accesses = array("d")
        self.scores = array("d")  # eviction.retention_score, cached for the heap
        self.flags = array("B")  # LIVE | PINNED
        self.namespace_ids = array("I")  # index into _namespaces
        self._free_slots = array("i")  # a stack of slots below capacity that are not live
        self._namespaces: list[bytes] = []
        self._namespace_ids: dict[bytes, int] = {}
        self._usage: dict[int, NamespaceUsage] = {}
        self.num_entries = 0
        self.num_bytes = 0
        self.pinned_bytes = 0
        self.heap = SlotHeap(self.scores, self.last_accesses, self.keys)
        self.shares = {tenant: Share(tenant, max_bytes, SlotHeap(self.scores, self.last_accesses, self.keys))
                       for tenant, max_bytes in (share_budgets or {}).items()}
        self._namespace_shares: list[Share | None] = []  # by namespace id

    @property
    def capacity(self) -> int:
        return len(self.flags)

    def __len__(self) -> int:
        return self.num_entries

    def is_live(self, slot: int) -> bool:
        return 0 <= slot < self.capacity and bool(self.flags[slot] & LIVE)

    def key_of(self, slot: int) -> ChunkKey:
        return ChunkKey(bytes(self.keys[slot * DIGEST_SIZE:(slot + 1) * DIGEST_SIZE]))

    def reserve_slots(self, count: int) -> list[int]:
        """Slots for `count` new chunks (free ones first); `release_slots` gives back unused ones."""
        taken = [self._free_slots.pop() for _ in range(min(count, len(self._free_slots)))]
        num_new = count - len(taken)
        if num_new:
            first_new = self.capacity
            self._grow(first_new + num_new)  # may add more rows than asked: they go on the free stack
            taken += range(first_new, first_new + num_new)
            self._free_slots.extend(range(self.capacity - 1, first_new + num_new - 1, -1))
        return taken

    def release_slots(self, slots: list[int]) -> None:
        self._free_slots.extend(reversed([slot for slot in slots if not self.is_live(slot)]))

    def load(self, key_rows: np.ndarray, metas: np.ndarray) -> None:
        """Adds a batch of committed chunks at once (store.decode_meta_batch's arrays); call
        `finish_load` after the last batch. key_rows: uint8 [n, 32]; metas: store.META_DTYPE [n]."""
        slots = metas["slot"].astype(np.int64)
        assert len(slots) == 0 or slots.min() >= 0, "a stored chunk has no slot"
        self._grow(int(slots.max(initial=-1)) + 1)
        flags = np.frombuffer(self.flags, dtype=np.uint8)
        assert not (flags[slots] & LIVE).any() and len(np.unique(slots)) == len(slots), "two chunks share a slot"
        sizes = metas["size_bytes"].astype(np.int64)
        pinned = metas["pinned"].astype(bool)
        np.frombuffer(self.keys, dtype=np.uint8).reshape(-1, DIGEST_SIZE)[slots] = key_rows
        np.frombuffer(self.sizes, dtype=np.int64)[slots] = sizes
        np.frombuffer(self.frequencies, dtype=np.float64)[slots] = metas["frequency"]
        np.frombuffer(self.last_accesses, dtype=np.float64)[slots] = metas["last_access"]
        flags[slots] = LIVE | np.where(pinned, PINNED, 0)
        namespaces, inverse = np.unique(metas["namespace"], return_inverse=True)
        namespace_ids = np.array([self._namespace_id(bytes(namespace)) for namespace in namespaces], dtype=np.uint32)
        np.frombuffer(self.namespace_ids, dtype=np.uint32)[slots] = namespace_ids[inverse]
        for index, namespace_id in enumerate(namespace_ids.tolist()):
            mine = inverse == index
            usage = self._usage.setdefault(namespace_id, NamespaceUsage())
            usage.num_entries += int(mine.sum())
            usage.num_bytes += int(sizes[mine].sum())
            usage.num_pinned += int(pinned[mine].sum())
            share = self._namespace_shares[namespace_id]
            if share is not None:
                share.num_bytes += int(sizes[mine].sum())
                share.pinned_bytes += int(sizes[mine & pinned].sum())
        self.num_entries += len(slots)
        self.num_bytes += int(sizes.sum())
        self.pinned_bytes += int(sizes[pinned].sum())

    def finish_load(self) -> None:
        """Scores, the heap (sorted by rank, which is a heap) and the free stack, vectorized."""
        flags = np.frombuffer(self.flags, dtype=np.uint8)
        frequencies = np.frombuffer(self.frequencies, dtype=np.float64)
        last_accesses = np.frombuffer(self.last_accesses, dtype=np.float64)
        scores = np.frombuffer(self.scores, dtype=np.float64)
        with np.errstate(divide="ignore"):  # frequency 0 scores -inf, as retention_score says
            scores[:] = np.where(frequencies > 0, np.log2(frequencies), -np.inf) + last_accesses / self.half_life
        queued = np.flatnonzero(flags == LIVE)  # live and not pinned
        # Keys as 4 big-endian words sort like the bytes; lexsort's last column is the first criterion.
        words = np.frombuffer(self.keys, dtype=">u8").reshape(-1, DIGEST_SIZE // 8)[queued]
        order = np.lexsort((words[:, 3], words[:, 2], words[:, 1], words[:, 0], last_accesses[queued], scores[queued]))
        ordered = queued[order]
        self.heap.replace_all(ordered)
        if self.shares:  # a sorted subsequence is sorted too: each share's heap is its part of the order
            shares = list(self.shares.values())  # Share compares by identity
            table = np.array([-1 if share is None else shares.index(share) for share in self._namespace_shares]
                             or [-1], dtype=np.int64)
            share_ids = table[np.frombuffer(self.namespace_ids, dtype=np.uint32)[ordered]]
            for index, share in enumerate(shares):
                share.heap.replace_all(ordered[share_ids == index])
        self._free_slots = array("i", np.flatnonzero(flags == 0)[::-1].astype(np.int32).tobytes())

    def add(self, key: ChunkKey, entry: Entry) -> None:
        slot = entry.slot
        assert 0 <= slot < self.capacity and not self.flags[slot] & LIVE, f"slot {slot} is not reserved"
        self.keys[slot * DIGEST_SIZE:(slot + 1) * DIGEST_SIZE] = key
        self.sizes[slot] = entry.size_bytes
        self.namespace_ids[slot] = self._namespace_id(entry.namespace)
        self._set_rank(slot, entry)
        self._count(slot, +1)
        if not entry.pinned:
            self.heap.push(slot)
            if (share := self.share_of(slot)) is not None:
                share.heap.push(slot)

    def remove(self, slot: int) -> None:
        assert self.is_live(slot), f"slot {slot} is not live"
        if slot in self.heap:
            self.heap.remove(slot)
            if (share := self.share_of(slot)) is not None:
                share.heap.remove(slot)
        self._count(slot, -1)
        self.flags[slot] = 0
        self._free_slots.append(slot)

    def replace(self, entry: Entry) -> None:
        """New frequency, last access or pin of a stored chunk (its key, size and namespace stay)."""
        slot = entry.slot
        assert self.is_live(slot) and self.sizes[slot] == entry.size_bytes, f"slot {slot} does not hold this entry"
        self._count(slot, -1)
        was_queued = slot in self.heap
        self._set_rank(slot, entry)
        self._count(slot, +1)
        share = self.share_of(slot)
        heaps = [self.heap] if share is None else [self.heap, share.heap]
        for heap in heaps:
            if entry.pinned and was_queued:
                heap.remove(slot)
            elif not entry.pinned and not was_queued:
                heap.push(slot)
            elif was_queued:
                heap.update(slot)

    def iter_victims(self, share: Share | None = None) -> Iterator[tuple[int, int]]:
        """(slot, size) of unpinned chunks (of one tenant's share when given), the first to evict first."""
        sizes = self.sizes
        for slot in (self.heap if share is None else share.heap).iter_in_order():
            yield slot, sizes[slot]

    def share_of(self, slot: int) -> Share | None:
        return self._namespace_shares[self.namespace_ids[slot]]

    def share_of_namespace(self, namespace: bytes) -> Share | None:
        namespace_id = self._namespace_ids.get(namespace)
        return None if namespace_id is None else self._namespace_shares[namespace_id]

    def assign_owner(self, namespace: bytes, tenant: str) -> None:
        """The namespace belongs to `tenant`: its chunks count in the tenant's share, when it has one.
        Chunks already stored under it (by an admin, or before tenancy) move into the share: one
        scan of the namespace, done once, since a namespace's owner never changes."""
        share = self.shares.get(tenant)
        namespace_id = self._namespace_id(namespace)
        current = self._namespace_shares[namespace_id]
        if current is share:
            return
        assert current is None, f"namespace {namespace.hex()[:16]} already counts in {current.tenant}'s share"
        slots = self.slots_in_namespace(namespace)
        self._namespace_shares[namespace_id] = share
        for slot in slots:
            self._count_share(share, slot, +1)
            if slot in self.heap:
                share.heap.push(slot)

    def slots_in_namespace(self, namespace: bytes) -> list[int]:
        namespace_id = self._namespace_ids.get(namespace)
        if namespace_id is None:
            return []
        live = np.frombuffer(self.flags, dtype=np.uint8) & LIVE
        same = np.frombuffer(self.namespace_ids, dtype=np.uint32) == namespace_id
        return np.flatnonzero(live.astype(bool) & same).tolist()

    def usage(self) -> dict[bytes, NamespaceUsage]:
        """A copy of the per-namespace totals."""
        return {self._namespaces[namespace_id]: NamespaceUsage(usage.num_entries, usage.num_bytes, usage.num_pinned)
                for namespace_id, usage in self._usage.items()}

    def _set_rank(self, slot: int, entry: Entry) -> None:
        self.frequencies[slot] = entry.frequency
        self.last_accesses[slot] = entry.last_access
        self.scores[slot] = retention_score(entry, self.half_life)
        self.flags[slot] = LIVE | (PINNED if entry.pinned else 0)

    def _count(self, slot: int, sign: int) -> None:
        size, pinned = self.sizes[slot], bool(self.flags[slot] & PINNED)
        namespace_id = self.namespace_ids[slot]
        usage = self._usage.setdefault(namespace_id, NamespaceUsage())
        usage.num_entries += sign
        usage.num_bytes += sign * size
        usage.num_pinned += sign * pinned
        if usage.num_entries == 0:
            del self._usage[namespace_id]
        self.num_entries += sign
        self.num_bytes += sign * size
        self.pinned_bytes += sign * size * pinned
        if (share := self._namespace_shares[namespace_id]) is not None:
            self._count_share(share, slot, sign)

    def _count_share(self, share: Share, slot: int, sign: int) -> None:
        size = self.sizes[slot]
        share.num_bytes += sign * size
        share.pinned_bytes += sign * size * bool(self.flags[slot] & PINNED)

    def _namespace_id(self, namespace: bytes) -> int:
        namespace_id = self._namespace_ids.get(namespace)
        if namespace_id is None:
            namespace_id = self._namespace_ids[namespace] = len(self._namespaces)
            self._namespaces.append(namespace)
            self._namespace_shares.append(None)
        return namespace_id

    def _grow(self, capacity: int) -> None:
        """At least `capacity` slots; new ones are not live (and not on the free stack)."""
        if capacity <= self.capacity:
            return
        capacity = max(capacity, self.capacity + max(_MIN_GROWTH, self.capacity // 8))
        extra = capacity - self.capacity
        self.keys.extend(bytes(extra * DIGEST_SIZE))
        for column in (self.sizes, self.frequencies, self.last_accesses, self.scores, self.flags, self.namespace_ids):
            column.frombytes(bytes(extra * column.itemsize))
        self.heap.grow(capacity)
        for share in self.shares.values():
            share.heap.grow(capacity)
