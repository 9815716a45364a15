"""What each tier placed and how long it took, and a line (fixed cost + cost per unit) fitted to such samples (pure)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from inference_service.store.protocol import ChunkStore


@dataclass(slots=True, frozen=True)
class TierLoad:
    """Chunks one tier placed into a request's slot: K/V bytes, and the host's seconds from the tier's first read to
    its last copy issued. copy_span: on CUDA, events recorded before and after the tier's copies (objects with
    query() and elapsed_time()); the load's time is then counted to the copies' completion (see loaded_seconds)."""

    tier: str  # "l0", "host", or the store's (store_tier)
    num_chunks: int
    num_bytes: int
    seconds: float
    copy_span: tuple[Any, Any] | None = None


def loaded_seconds(load: TierLoad) -> float | None:
    """Seconds from the tier's first read to its copies' completion: the host's issue time, or the device's time
    between the span's events when longer (the copies ran after the host issued them); None while the copies
    still run (ask again later: this never waits for them)."""
    if load.copy_span is None:
        return load.seconds
    before, after = load.copy_span
    if not after.query():
        return None
    return max(load.seconds, before.elapsed_time(after) / 1000)


def store_tier(store: ChunkStore) -> str:
    """The tier name a store's placements count under: the daemon's map read in place, its Fetch stream, or
    another store (tests, in-process)."""
    mode = getattr(store, "read_mode", "")
    return {"locked_map": "daemon_map", "stream": "daemon_fetch", "remote": "daemon_fetch"}.get(mode, "store")


SEED_WEIGHT = 0.1  # a start-up measurement against a request's sample: the requests soon decide


@dataclass(slots=True, frozen=True)
class CostModel:
    """seconds = fixed_s + units * per_unit_s: a load (units: bytes) or a prefill (units: tokens). The fixed cost is
    what makes a break-even length: below it a load's fixed cost outweighs the prefill it spares."""

    fixed_s: float
    per_unit_s: float

    def __post_init__(self) -> None:
        assert self.fixed_s >= 0 and self.per_unit_s >= 0, f"a cost is not negative: {self}"

    def seconds(self, units: float) -> float:
        return self.fixed_s + units * self.per_unit_s


class CostMeter:
    """A CostModel fitted by weighted least squares to (units, seconds) samples: each request's sample enters with
    weight 1 and the older ones decay by `keep`, so a tier that slows down shows it within a few requests; start-up
    measurements (seed) keep a small weight for good, so their spread of sizes keeps the line's slope when the
    requests all have one size. Thread-safe.
    """

    def __init__(self, keep: float = 0.8, clock: Callable[[], float] = time.monotonic) -> None:
        assert 0.0 <= keep < 1.0, f"keep must be in [0, 1), got {keep}"
        self._keep = keep
        self._clock = clock
        self._seed = [0.0] * 5  # weight, sum x, sum y, sum x*x, sum x*y
        self._recent = [0.0] * 5
        self.samples = 0
        self.last_sample_at: float | None = None  # by the clock, None before any sample (seeds are not samples)
        self._lock = threading.Lock()

    def seed(self, points: Sequence[tuple[float, float]]) -> None:
        """Start-up measurements (units, seconds), kept at full weight."""
        with self._lock:
            for units, seconds in points:
                _accumulate(self._seed, units, seconds, SEED_WEIGHT)

    def add(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        with self._lock:
            self._recent = [total * self._keep for total in self._recent]
            _accumulate(self._recent, units, seconds)
            self.samples += 1
            self.last_sample_at = self._clock()

    @property
    def model(self) -> CostModel | None:
        """The fitted line; None before any seed or sample. Samples all of one size fit a line through the origin
        (no fixed cost can be told apart from them)."""
        with self._lock:
            weight, sx, sy, sxx, sxy = (seed + recent for seed, recent in zip(self._seed, self._recent))
        if weight <= 0 or sx <= 0:
            return None
        spread = weight * sxx - sx * sx
        if spread > 1e-9 * weight * sxx:
            per_unit = (weight * sxy - sx * sy) / spread
            fixed = (sy - per_unit * sx) / weight
            if per_unit >= 0 and fixed >= 0:
                return CostModel(fixed, per_unit)
            if per_unit < 0:  # slower on smaller sizes: all fixed cost
                return CostModel(max(sy / weight, 0.0), 0.0)
        return CostModel(0.0, max(sxy / sxx, 0.0))  # through the origin


def _accumulate(totals: list[float], units: float, seconds: float, weight: float = 1.0) -> None:
    totals[0] += weight
    totals[1] += weight * units
    totals[2] += weight * seconds
    totals[3] += weight * units * units
    totals[4] += weight * units * seconds
