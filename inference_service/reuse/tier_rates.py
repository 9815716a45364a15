"""What each tier placed and how fast, and the choice between loading a prefix and recomputing it (pure)."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from inference_service.store.protocol import ChunkStore


@dataclass(slots=True, frozen=True)
class TierLoad:
    """Chunks one tier placed into a request's slot: K/V bytes, and the host's seconds from the tier's first read to
    its last copy issued (on CUDA the copies may still run: the request's first forward waits for them)."""

    tier: str  # "l0", or the store's (store_tier)
    num_chunks: int
    num_bytes: int
    seconds: float


def store_tier(store: ChunkStore) -> str:
    """The tier name a store's placements count under: the daemon's map read in place, its Fetch stream, or
    another store (tests, in-process)."""
    mode = getattr(store, "read_mode", "")
    return {"locked_map": "daemon_map", "stream": "daemon_fetch", "remote": "daemon_fetch"}.get(mode, "store")


class RateMeter:
    """A measured rate (units per second) that follows the recent samples: totals decayed by `keep` per sample, so a
    tier that slows down (a busy link) shows it within a few requests. Thread-safe."""

    def __init__(self, keep: float = 0.8) -> None:
        assert 0.0 <= keep < 1.0, f"keep must be in [0, 1), got {keep}"
        self._keep = keep
        self._units = 0.0
        self._seconds = 0.0
        self.samples = 0
        self._lock = threading.Lock()

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        with self._lock:
            self._units = self._units * self._keep + units
            self._seconds = self._seconds * self._keep + seconds
            self.samples += 1

    @property
    def rate(self) -> float | None:
        """Units per second; None before any sample."""
        with self._lock:
            return self._units / self._seconds if self._seconds else None


def load_is_slower(num_tokens: int, bytes_per_token: int, load_bytes_per_s: float | None,
                   prefill_tokens_per_s: float | None) -> bool:
    """Whether loading num_tokens' K/V from a tier would take longer than prefilling them, by the measured rates.

    Unmeasured (either rate None): False, the cache is tried first and measured. Equal: load (it spares the
    device's compute for the other requests).
    """
    if num_tokens <= 0 or not load_bytes_per_s or not prefill_tokens_per_s:
        return False
    return num_tokens * bytes_per_token / load_bytes_per_s > num_tokens / prefill_tokens_per_s
