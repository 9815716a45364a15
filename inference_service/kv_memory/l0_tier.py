"""L0: decoded K/V of the chunks this service wrote back or fetched, kept in its own memory (the device's on a GPU):
a repeated prefix is one copy into the slot, with no daemon read, checksum or decoding, and no wait for a write-back."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inference_service.kv_memory.l0_eviction import DEFAULT_HALF_LIFE_S, L0Entry, plan_admission, record_hit
from inference_service.store.protocol import ChunkStore, DeleteEpoch, NullStore
from kvboost_common.kv_events.sink import KvEventSink

logger = logging.getLogger(__name__)

KV = tuple[torch.Tensor, torch.Tensor]  # a chunk's keys, values: [layers, kv_heads, n, head_dim]
# Takes a chunk L0 evicts (key, keys, values, parent): the host tier (host_tier.HostTier.add).
Spill = Callable[[bytes, torch.Tensor, torch.Tensor, "bytes | None"], bool]


@dataclass(slots=True)
class L0TierStats:
    chunks_hit: int = 0  # whole chunks placed from L0
    bytes_placed: int = 0  # their K/V bytes
    chunks_added: int = 0
    chunks_evicted: int = 0
    chunks_rejected: int = 0  # not kept: only their own ancestors could have made room (see l0_eviction)
    chunks_alone: int = 0  # whole chunks the daemon no longer held that runs were extended through (extend_run)


class L0Tier:
    """Whole chunks' K/V by prefix key within max_bytes, evicted leaf first by decayed frequency (l0_eviction).

    Exact by construction: an entry holds the K/V the service computed (or decoded) for exactly that key (a prefix
    key commits to every token before it), the values a hit on the daemon's 16-bit blob decodes to; the engine keeps
    none for quantized storage. A chunk the daemon's Lookup confirms hits. L0 alone answers for a chunk whose
    write-back is still in flight (pending), and for one the daemon evicted for its budget but confirmed (or that was
    added) at the delete epoch the request's Lookup carries: no Delete has reached the daemon since, so a Delete (by
    keys or namespace) still reaches every request. Thread-safe: the write-back threads add and settle, the step loop
    reads and confirms.
    """

    def __init__(self, max_bytes: int, half_life: float = DEFAULT_HALF_LIFE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert max_bytes > 0, f"max_bytes must be positive, got {max_bytes}"
        assert half_life > 0, f"half_life must be positive, got {half_life}"
        self.max_bytes = max_bytes
        self.half_life = half_life
        self.bytes_held = 0
        self.stats = L0TierStats()
        self._clock = clock
        self._kv: dict[bytes, KV] = {}
        self._entries: dict[bytes, L0Entry] = {}  # what eviction weighs, by the same keys as _kv
        self._pending: set[bytes] = set()  # added by a write-back the daemon has not confirmed yet
        # The newest delete epoch a Lookup carried (None: none seen), and the epoch at which each held chunk was last
        # confirmed by the daemon or added: the chunks L0 may answer for alone while that epoch is current.
        self._epoch: DeleteEpoch | None = None
        self._confirmed: dict[bytes, DeleteEpoch] = {}
        self._asked = 0  # the latest-asked Lookup that answered at the current epoch (DeleteEpoch.asked)
        self._lock = threading.Lock()
        # The host tier, when there is one: L0's evicted chunks go there. L0 still counts only its own chunks as held
        # (a chunk whose parent is only in the host tier is an orphan here), so L0 keeps a prefix's head.
        self.spill: Spill | None = None
        # Told of every chunk that enters or leaves, under the lock, so the order it hears is the tier's, and of each
        # planned prompt's chunk tokens (engine_parts/planning.py): the KV-event publisher (kvboost_common/kv_events).
        self.listener: KvEventSink | None = None

    def __len__(self) -> int:
        return len(self._kv)

    def __contains__(self, key: bytes) -> bool:
        return key in self._kv

    def holds(self, key: bytes, num_tokens: int) -> bool:
        """Whether take_run would take the chunk now (held, of that length); counts no hit."""
        entry = self._kv.get(key)
        return entry is not None and entry[0].shape[2] == num_tokens

    def is_pending(self, key: bytes) -> bool:
        """Held, and its write-back to the daemon has not ended."""
        return key in self._pending and key in self._kv

    def confirm(self, epoch: DeleteEpoch | None, keys: Sequence[bytes]) -> bool:
        """A Lookup answered at `epoch` found `keys` at the daemon: L0 may answer for those it holds alone until a
        Delete moves the epoch on. Within one daemon start the count orders answers; between starts, the order the
        Lookups were asked in (a late answer from before a restart confirms nothing, and one asked after the current
        epoch's Lookup moves L0 to its start, however often starts alternate). A new epoch voids every earlier
        confirmation. Returns whether `epoch` is the current one (runs may extend at it)."""
        if epoch is None:
            return False
        with self._lock:
            current = self._epoch
            newer = current is None or (epoch.count > current.count if epoch.id == current.id
                                        else epoch.asked > self._asked)
            if newer:
                self._epoch = epoch
            elif epoch.id != current.id or epoch.count < current.count:
                return False
            self._asked = max(self._asked, epoch.asked)
            for key in keys:
                if key in self._kv:
                    self._confirmed[key] = epoch
        return True

    def serves_alone(self, key: bytes, epoch: DeleteEpoch | None) -> bool:
        """Whether L0 may place the chunk without the daemon holding it, for a Lookup answered at `epoch`: it was
        confirmed, or added by its own write-back, at that epoch, and the epoch is still current; with a store that
        keeps no epoch (None), only while its write-back is in flight."""
        with self._lock:
            return self._serves_alone(key, epoch)

    def _serves_alone(self, key: bytes, epoch: DeleteEpoch | None) -> bool:
        if key not in self._kv:
            return False
        if epoch is None:
            return key in self._pending
        # A write-back's chunk too: after a Delete (of it, perhaps) the daemon decides again, as for any other.
        return epoch == self._epoch and self._confirmed.get(key) == epoch

    def extend_run(self, keys: Sequence[bytes], run: int, epoch: DeleteEpoch | None) -> int:
        """The run of `run` leading keys the daemon confirmed, extended through the keys after it L0 serves alone;
        counts those it serves only by the epoch (the daemon evicted them)."""
        with self._lock:
            alone = 0
            while run < len(keys) and self._serves_alone(keys[run], epoch):
                alone += keys[run] not in self._pending
                run += 1
            self.stats.chunks_alone += alone
        return run

    def settle(self, keys) -> None:
        """Their write-back ended (stored or failed): from now on they hit when the daemon's Lookup confirms them,
        or alone while the delete epoch they were added at is current (serves_alone)."""
        with self._lock:
            self._pending.difference_update(keys)

    def take(self, key: bytes) -> KV | None:
        """The chunk's keys, values [layers, kv_heads, n, head_dim] (not to be written), or None; counts a hit."""
        taken = self.take_run([key], [None])
        return taken[0] if taken else None

    def take_run(self, keys: Sequence[bytes], lengths: Sequence[int | None]) -> list[KV]:
        """The K/V of the leading keys L0 holds with the given token counts (None: any), up to the first it does not:
        one lock for the whole run. Counts a hit on each (not to be written)."""
        now = self._clock()
        taken: list[KV] = []
        with self._lock:
            for key, length in zip(keys, lengths):
                entry = self._kv.get(key)
                if entry is None or (length is not None and entry[0].shape[2] != length):
                    break
                self._entries[key] = record_hit(self._entries[key], now, self.half_life)
                taken.append(entry)
            self.stats.chunks_hit += len(taken)
            self.stats.bytes_placed += sum(self._entries[key].size_bytes for key in keys[: len(taken)])
        return taken

    def add(self, key: bytes, keys: torch.Tensor, values: torch.Tensor, pending: bool = False,
            parent: bytes | None = None, epoch: DeleteEpoch | None = None) -> bool:
        """Keeps copies of a chunk's K/V (keys, values: [layers, kv_heads, n, head_dim]); returns whether L0 holds it.

        parent: the prefix key the chunk chains from (None: a prompt's first chunk). A chunk is
        not kept when it is larger than the whole tier or only its ancestors could make room (l0_eviction).
        pending: its write-back is starting (see is_pending; settle ends it). epoch: the delete epoch of the Lookup
        its K/V were computed after (None: none answered); the daemon leaves the chunk out if a Delete since named it,
        so L0 counts it as confirmed only if that epoch is the current one (None: at the current one, as the daemon
        stores a chunk without an epoch whatever was deleted).
        """
        size = _nbytes((keys, values))
        with self._lock:
            if key in self._kv:
                if pending:
                    self._pending.add(key)
                return True
        kv = (keys.clone(), values.clone())  # outside the lock: the slot may be reused once this returns
        with self._lock:
            if key in self._kv:
                return True
            incoming = L0Entry(size, parent, 1.0, self._clock())
            victims = [] if self.bytes_held + size <= self.max_bytes else plan_admission(
                self._entries, key, incoming, self.max_bytes, self.half_life)
            if victims is None:
                self.stats.chunks_rejected += 1
                return False
            evicted = [self._drop(victim) for victim in victims]
            self._kv[key], self._entries[key] = kv, incoming
            if pending and self._epoch is not None and (epoch is None or epoch == self._epoch):
                # Computed after every Delete so far, or stored without an epoch (then whatever was deleted): the
                # daemon will hold it. A fetched chunk waits for a Lookup to confirm it.
                self._confirmed[key] = self._epoch
            self.bytes_held += size
            self.stats.chunks_added += 1
            if self.listener is not None:
                self.listener.chunk_added(key, parent)
            if pending:
                self._pending.add(key)
        self._maybe_spill(evicted)
        return True

    def _drop(self, key: bytes) -> tuple[bytes, KV, bytes | None]:
        kv = self._kv.pop(key)
        entry = self._entries.pop(key)
        self.bytes_held -= entry.size_bytes
        self._pending.discard(key)
        self._confirmed.pop(key, None)
        self.stats.chunks_evicted += 1
        if self.listener is not None:
            self.listener.chunk_removed(key)
        return key, kv, entry.parent

    def _maybe_spill(self, evicted: list[tuple[bytes, KV, bytes | None]]) -> None:
        """Hands evicted chunks to the host tier, outside L0's lock (the copy waits on this thread, not the step
        loop's); one that fails is only lost to the host tier."""
        if self.spill is None:
            return
        for key, (keys, values), parent in reversed(evicted):  # parents first: each arrives with its parent held
            try:
                self.spill(key, keys, values, parent)
            except Exception:
                logger.exception("moving an L0 chunk to the host tier failed")

    def snapshot(self) -> dict:
        """Counters under ServiceStatsReply names."""
        with self._lock:
            return {"l0_chunks_hit": self.stats.chunks_hit, "l0_bytes_placed": self.stats.bytes_placed,
                    "l0_bytes_held": self.bytes_held, "l0_chunks_held": len(self._kv),
                    "l0_chunks_evicted": self.stats.chunks_evicted, "l0_chunks_rejected": self.stats.chunks_rejected,
                    "l0_chunks_alone": self.stats.chunks_alone}


def l0_tier_for(max_bytes: int, kv_cache_bits: int, store: ChunkStore | None = None) -> L0Tier | None:
    """L0 of max_bytes (None: off), kept only at 16-bit storage, where a blob decodes to exactly what was computed:
    a quantized blob decodes to other values, which an L0 copy of the computed ones would not match. No L0 without
    a cache either: a NullStore means every request runs without one."""
    if isinstance(store, NullStore):
        return None
    return L0Tier(max_bytes) if max_bytes and kv_cache_bits == 16 else None


def _nbytes(entry: KV) -> int:
    keys, values = entry
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()
