"""L0: decoded K/V of the chunks this service wrote back or fetched, kept in its own memory (the device's on a GPU):
a repeated prefix is one copy into the slot, with no daemon read, checksum or decoding, and no wait for a write-back."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class HotTierStats:
    chunks_hit: int = 0  # whole chunks placed from L0
    bytes_placed: int = 0  # their K/V bytes
    chunks_added: int = 0
    chunks_evicted: int = 0


class HotTier:
    """Whole chunks' K/V by prefix key, least recently used evicted first, within max_bytes.

    Exact by construction: an entry holds the K/V the service computed (or decoded) for exactly that key (a prefix
    key commits to every token before it), the values a hit on the daemon's 16-bit blob decodes to; the engine keeps
    none for quantized storage. The daemon's Lookup decides what hits; a chunk whose write-back is still in flight
    (pending) may hit on L0 alone. Thread-safe: the write-back threads add and settle, the step loop reads.
    """

    def __init__(self, max_bytes: int) -> None:
        assert max_bytes > 0, f"max_bytes must be positive, got {max_bytes}"
        self.max_bytes = max_bytes
        self.bytes_held = 0
        self.stats = HotTierStats()
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._pending: set[bytes] = set()  # added by a write-back the daemon has not confirmed yet
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def is_pending(self, key: bytes) -> bool:
        """Held, and its write-back to the daemon has not ended: L0 alone may serve it (the daemon's Lookup
        decides for every other key, so a Delete at the daemon reaches this process too)."""
        return key in self._pending and key in self._entries

    def settle(self, keys) -> None:
        """Their write-back ended (stored or failed): from now on the daemon's Lookup decides whether they hit."""
        with self._lock:
            self._pending.difference_update(keys)

    def take(self, key: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The chunk's keys, values [layers, kv_heads, n, head_dim] (not to be written), or None; counts a hit."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.stats.chunks_hit += 1
            self.stats.bytes_placed += _nbytes(entry)
            return entry

    def add(self, key: bytes, keys: torch.Tensor, values: torch.Tensor, pending: bool = False) -> None:
        """Keeps copies of a chunk's K/V (keys, values: [layers, kv_heads, n, head_dim]); a chunk larger than the
        whole tier is not kept. pending: its write-back is starting (see is_pending; settle ends it)."""
        size = keys.numel() * keys.element_size() + values.numel() * values.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            if pending:
                self._pending.add(key)
            if key in self._entries:
                self._entries.move_to_end(key)
                return
        entry = (keys.clone(), values.clone())  # outside the lock: the slot may be reused once this returns
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = entry
            self.bytes_held += size
            self.stats.chunks_added += 1
            while self.bytes_held > self.max_bytes:
                evicted_key, evicted = self._entries.popitem(last=False)
                self._pending.discard(evicted_key)
                self.bytes_held -= _nbytes(evicted)
                self.stats.chunks_evicted += 1

    def snapshot(self) -> dict:
        """Counters under ServiceStatsReply names."""
        with self._lock:
            return {"l0_chunks_hit": self.stats.chunks_hit, "l0_bytes_placed": self.stats.bytes_placed,
                    "l0_bytes_held": self.bytes_held, "l0_chunks_held": len(self._entries),
                    "l0_chunks_evicted": self.stats.chunks_evicted}


def hot_tier_for(max_bytes: int, kv_cache_bits: int) -> HotTier | None:
    """L0 of max_bytes (None: off), kept only at 16-bit storage, where a blob decodes to exactly what was computed:
    a quantized blob decodes to other values, which an L0 copy of the computed ones would not match."""
    return HotTier(max_bytes) if max_bytes and kv_cache_bits == 16 else None


def _nbytes(entry: tuple[torch.Tensor, torch.Tensor]) -> int:
    keys, values = entry
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()
