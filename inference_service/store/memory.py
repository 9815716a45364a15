"""InMemoryStore: a dict-backed chunk store inside the service's own process.

Supported for single-process use (a notebook, a script that embeds the Engine) and as the in-process
row of the TTFT benchmark; the served product uses the daemon (store/grpc_store.py).
"""
from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import Iterator

from inference_service.store.protocol import (AfterRun, ContinuationQuery, DeleteEpoch, StoreItem, StoreLookup,
                                              common_prefix, lookup_order)
from kvboost_keys.chunk_keys import partial_prefix_keys


@dataclass(slots=True)
class _Entry:
    namespace: bytes
    content_key: bytes | None
    num_tokens: int
    blob: bytearray  # writable, so decoding shares it instead of copying; never written after store
    pin: bool
    token_ids: tuple[int, ...] = ()


class InMemoryStore:
    """A dict-backed ChunkStore for tests and the in-process benchmark; thread-safe, unbounded."""

    def __init__(self) -> None:
        self.degraded = False
        self._entries: dict[bytes, _Entry] = {}
        self._content_index: dict[bytes, bytes] = {}  # content key -> newest prefix key stored with it
        self._children: dict[bytes, dict[bytes, None]] = {}  # parent key -> child keys, in storing order
        self._lock = threading.Lock()
        self._epoch_id = secrets.token_hex(8)  # the daemon's delete epoch, kept alike (DeleteEpoch)
        self._deletes = 0
        self._deleted: list[tuple[int, frozenset[bytes]]] = []  # each Delete: the count it made, the keys it named

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def lookup(self, namespace: bytes, prefix_keys: list[bytes], content_keys: list[bytes] | None = None,
               partial_keys: list[bytes] | None = None, continuation: ContinuationQuery | None = None,
               after_run: AfterRun | None = None) -> StoreLookup:
        with self._lock:
            epoch = DeleteEpoch(self._epoch_id, self._deletes, lookup_order())
            run = 0
            while run < len(prefix_keys) and self._holds(namespace, prefix_keys[run]):
                run += 1
        if after_run is not None:  # what the daemon does: the second question asked of the run just found
            return self._after_run(namespace, prefix_keys, content_keys, run, after_run)
        with self._lock:
            content_hits: dict[int, bytes] = {}
            for index, content_key in enumerate(content_keys or ()):
                stored = self._content_index.get(content_key)
                if index >= run and stored is not None and self._holds(namespace, stored):
                    content_hits[index] = stored
            partial = next((i for i, key in enumerate(partial_keys or ()) if self._holds(namespace, key)), None)
            best_key, best_shared = None, 0
            if continuation is not None:
                for child in self._children.get(continuation.parent, ()):
                    if self._holds(namespace, child):
                        shared = common_prefix(continuation.token_ids, self._entries[child].token_ids)
                        if shared > best_shared:
                            best_key, best_shared = child, shared
        return StoreLookup(run, content_hits, partial, best_key, best_shared, delete_epoch=epoch)

    def _after_run(self, namespace: bytes, prefix_keys: list[bytes], content_keys: list[bytes] | None, run: int,
                   after_run: AfterRun) -> StoreLookup:
        parent = prefix_keys[run - 1] if run else namespace
        packed = after_run.tokens_after[run] if run < len(after_run.tokens_after) else b""
        token_ids = tuple(int.from_bytes(packed[i : i + 4], "little") for i in range(0, len(packed), 4))
        candidates = partial_prefix_keys(parent, token_ids) if token_ids else []
        # InMemoryStore's own lookup, not a subclass's: one call, as the daemon answers it in one Lookup
        found = InMemoryStore.lookup(self, namespace, prefix_keys, content_keys, candidates,
                                     ContinuationQuery(parent, token_ids) if token_ids else None)
        index = found.partial_index
        return StoreLookup(found.prefix_run, found.content_hits, None, found.continuation_key,
                           found.continuation_tokens, continued=True,
                           partial_key=None if index is None else candidates[index],
                           partial_tokens=0 if index is None else len(candidates) - index,
                           delete_epoch=found.delete_epoch)

    def copy(self) -> InMemoryStore:
        """An independent store holding the same entries now (blobs are shared: none is written after store)."""
        twin = InMemoryStore()
        with self._lock:
            twin._entries = {key: _Entry(entry.namespace, entry.content_key, entry.num_tokens, entry.blob, entry.pin,
                                         entry.token_ids) for key, entry in self._entries.items()}
            twin._content_index = dict(self._content_index)
            twin._children = {parent: dict(children) for parent, children in self._children.items()}
        return twin

    def _holds(self, namespace: bytes, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.namespace == namespace

    def fetch(self, keys: list[bytes]) -> Iterator[tuple[bytes, bytearray | None]]:
        with self._lock:
            blobs = [(key, entry.blob if (entry := self._entries.get(key)) else None) for key in keys]
        yield from blobs

    def store(self, items: list[StoreItem]) -> int:
        with self._lock:
            items = [item for item in items if not self._superseded(item)]
            for item in items:
                self._entries[item.key] = _Entry(
                    item.namespace, item.content_key, item.num_tokens, bytearray(item.blob), item.pin,
                    tuple(item.token_ids))
                if item.parent_key and item.token_ids:
                    self._children.setdefault(item.parent_key, {})[item.key] = None
                if item.content_key is not None:
                    self._content_index[item.content_key] = item.key
        return len(items)

    def unpin(self, keys: list[bytes]) -> int:
        with self._lock:
            entries = [entry for key in keys if (entry := self._entries.get(key)) is not None]
            for entry in entries:
                entry.pin = False
        return len(entries)

    def pinned(self, key: bytes) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.pin

    def delete(self, keys: list[bytes]) -> None:
        """Drops entries as the daemon's Delete does: the delete epoch moves on once they are gone, and a Store whose
        epoch is older leaves them out."""
        self.evict(keys)
        with self._lock:
            self._deletes += 1
            self._deleted.append((self._deletes, frozenset(keys)))

    def _superseded(self, item: StoreItem) -> bool:
        """As the daemon's DeleteLog.supersedes: a Delete the item's epoch does not count names it. The caller holds
        _lock."""
        epoch = item.delete_epoch
        if epoch is None:
            return False
        if epoch.id != self._epoch_id or epoch.count > self._deletes:
            return True
        return any(count > epoch.count and item.key in keys for count, keys in self._deleted)

    def evict(self, keys: list[bytes]) -> None:
        """Drops entries as the daemon's budget does: the delete epoch stays."""
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)
