"""In-memory mirror of the stored metadata, with byte totals per namespace kept up to date."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from cache_daemon.entry import ChunkKey, Entry


@dataclass(slots=True)
class NamespaceUsage:
    num_entries: int = 0
    num_bytes: int = 0
    num_pinned: int = 0


class EntryIndex:
    """Key -> Entry for every committed chunk; no locking (the cache holds the lock)."""

    def __init__(self, entries: Mapping[ChunkKey, Entry] | None = None) -> None:
        self._entries: dict[ChunkKey, Entry] = {}
        self._usage: dict[bytes, NamespaceUsage] = {}
        self.num_bytes = 0
        for key, entry in (entries or {}).items():
            self.add(key, entry)

    @property
    def entries(self) -> Mapping[ChunkKey, Entry]:
        return self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: ChunkKey) -> Entry | None:
        return self._entries.get(key)

    def add(self, key: ChunkKey, entry: Entry) -> None:
        assert key not in self._entries, f"chunk {key.hex()} is already indexed"
        self._entries[key] = entry
        self._count(entry, +1)

    def remove(self, key: ChunkKey) -> Entry:
        entry = self._entries.pop(key)
        self._count(entry, -1)
        return entry

    def replace(self, key: ChunkKey, entry: Entry) -> None:
        self._count(self._entries[key], -1)
        self._entries[key] = entry
        self._count(entry, +1)

    def keys_in_namespace(self, namespace: bytes) -> list[ChunkKey]:
        return [key for key, entry in self._entries.items() if entry.namespace == namespace]

    def usage(self) -> dict[bytes, NamespaceUsage]:
        """A copy of the per-namespace totals."""
        return {namespace: NamespaceUsage(usage.num_entries, usage.num_bytes, usage.num_pinned)
                for namespace, usage in self._usage.items()}

    def _count(self, entry: Entry, sign: int) -> None:
        usage = self._usage.setdefault(entry.namespace, NamespaceUsage())
        usage.num_entries += sign
        usage.num_bytes += sign * entry.size_bytes
        usage.num_pinned += sign * entry.pinned
        self.num_bytes += sign * entry.size_bytes
        if usage.num_entries == 0:
            del self._usage[entry.namespace]
