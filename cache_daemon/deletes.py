"""The daemon's Deletes: the delete epoch every Lookup reply carries, and the recent Deletes a Store is checked
against, so a write-back whose K/V were computed before a Delete does not store again what that Delete removed.

A writer names the epoch of the Lookup it computed after (ChunkMeta.delete_epoch_id / delete_count on Store). The
Deletes it had not seen are those this start completed after that count, and those still running; a chunk one of
them names (by key, or by namespace) is superseded: not stored. The check runs inside LMDB's write lock (ChunkCache
.put_many) and each Delete is begun here before it removes anything, so a Store either commits before the Delete's
removal (which then removes it) or sees the Delete; L2's writes are checked before and after they reach Redis
(TieredCache._put_in_l2). A writer without an epoch (a warm-up, an older client) stores as before."""
from __future__ import annotations

import collections
import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:  # annotations only: entry.py imports WriterEpoch from here
    from cache_daemon.entry import IncomingChunk

# Completed Deletes remembered, and the keys they name together (a Delete by keys names up to 65,536): a writer
# whose epoch is older than every Delete remembered cannot be checked, so its chunks are superseded (a cache loses a
# write, never stores what a Delete removed).
MAX_REMEMBERED = 4096
MAX_REMEMBERED_KEYS = 1 << 18


@dataclass(slots=True, frozen=True)
class WriterEpoch:
    """What a Store's writer had seen: the delete epoch of its Lookup (this start's id and the count of Deletes),
    and whose count that is (viewer: a tenant's name; None without tenancy or for an admin, who see every Delete)."""

    epoch_id: str
    count: int
    viewer: str | None = None


@dataclass(slots=True, eq=False)
class Tombstone:
    """One Delete: by a tenant (None: without tenancy, or an admin: every caller's count holds it), of a namespace or
    of keys, in their stored (tenant-scoped) form. A Delete of corrupted blobs names nothing: a good copy may come
    back."""

    owner: str | None
    namespace: bytes | None
    keys: frozenset[bytes]
    done: bool = False

    def names(self, namespace: bytes, key: bytes) -> bool:
        return namespace == self.namespace or key in self.keys

    def counts_for(self, viewer: str | None) -> bool:
        return viewer is None or self.owner is None or self.owner == viewer


@dataclass(slots=True, frozen=True)
class Unseen:
    """What the Deletes a writer had not seen name, gathered once for all its chunks (everything: its epoch cannot
    be checked)."""

    everything: bool = False
    namespaces: frozenset[bytes] = frozenset()
    keys: frozenset[bytes] = frozenset()

    def names(self, namespace: bytes, key: bytes) -> bool:
        return self.everything or namespace in self.namespaces or key in self.keys


NOTHING_UNSEEN = Unseen()


class DeleteLog:
    """The delete counts (per caller), and the Deletes running and recently completed."""

    def __init__(self, max_remembered: int = MAX_REMEMBERED, max_keys: int = MAX_REMEMBERED_KEYS) -> None:
        self.epoch_id = secrets.token_hex(8)  # a new one each start: counts of another start say nothing here
        self._lock = threading.Lock()  # Deletes begin and end on store threads; Lookups read counts on the loop
        self._all = 0  # every Delete completed
        self._shared = 0  # without tenancy, or by an admin
        self._own: collections.Counter[str] = collections.Counter()  # by each tenant
        self._running: list[Tombstone] = []
        self._done: collections.deque[Tombstone] = collections.deque()  # completion order, newest last
        self._max_remembered = max_remembered
        self._max_keys = max_keys
        self._keys_remembered = 0

    def count_seen_by(self, viewer: str | None) -> int:
        """LookupReply.delete_count for a caller: the Deletes completed that could have named its chunks (a tenant:
        its own and the admins'; viewer None: every one)."""
        with self._lock:
            return self._all if viewer is None else self._shared + self._own[viewer]

    def begin(self, owner: str | None, namespace: bytes | None = None, keys: Iterable[bytes] = ()) -> Tombstone:
        """Records a Delete before it removes anything (a Store checked from now on leaves out what it names)."""
        stone = Tombstone(owner, namespace, frozenset(keys))
        with self._lock:
            self._running.append(stone)
        return stone

    def end(self, stone: Tombstone) -> None:
        """The Delete's chunks are gone (found or not): counted, in every count that holds it."""
        with self._lock:
            self._running.remove(stone)
            stone.done = True
            self._all += 1
            if stone.owner is None:
                self._shared += 1
            else:
                self._own[stone.owner] += 1
            self._done.append(stone)
            self._keys_remembered += len(stone.keys)
            while self._done and (len(self._done) > self._max_remembered or self._keys_remembered > self._max_keys):
                self._keys_remembered -= len(self._done.popleft().keys)

    def supersedes(self, writer: WriterEpoch | None, namespace: bytes, key: bytes) -> bool:
        """Whether a Delete the writer had not seen names the chunk (True too when that cannot be told: an epoch of
        another start, or older than the Deletes remembered). A writer without an epoch: False."""
        return self.unseen_by(writer).names(namespace, key)

    def not_superseded(self, chunks: Sequence[IncomingChunk]) -> list[IncomingChunk]:
        """The chunks no Delete their writer had not seen names (each writer's Deletes gathered once)."""
        unseen: dict[WriterEpoch | None, Unseen] = {}
        kept = []
        for chunk in chunks:
            if chunk.writer not in unseen:
                unseen[chunk.writer] = self.unseen_by(chunk.writer)
            if not unseen[chunk.writer].names(chunk.namespace, chunk.key):
                kept.append(chunk)
        return kept

    def unseen_by(self, writer: WriterEpoch | None) -> Unseen:
        """What the Deletes the writer had not seen name: those still running, and those completed after its count
        (the newest that many of the Deletes its viewer's count holds)."""
        if writer is None:
            return NOTHING_UNSEEN
        with self._lock:
            if writer.epoch_id != self.epoch_id:
                return Unseen(everything=True)
            missing = (self._all if writer.viewer is None else self._shared + self._own[writer.viewer]) - writer.count
            if missing < 0:  # a count this start never reached
                return Unseen(everything=True)
            unseen = list(self._running)
            for stone in reversed(self._done):
                if missing == 0:
                    break
                if stone.counts_for(writer.viewer):  # another tenant's Delete names nothing in this writer's key space
                    missing -= 1
                    unseen.append(stone)
            if missing > 0:  # older than every Delete remembered
                return Unseen(everything=True)
        if not unseen:
            return NOTHING_UNSEEN
        return Unseen(namespaces=frozenset(stone.namespace for stone in unseen if stone.namespace is not None),
                      keys=frozenset().union(*(stone.keys for stone in unseen)))
