"""Per-tier loads, and the cost lines (fixed cost + cost per unit) fitted to their samples."""
from __future__ import annotations

import pytest

from inference_service.kv_memory.tier_rates import CostMeter, CostModel, TierLoad, loaded_seconds, store_tier


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Event:
    """A CUDA event's timing: done once the copies it follows completed; elapsed_time in ms from another."""

    def __init__(self, at_ms: float, done: bool = True) -> None:
        self.at_ms, self.done = at_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: Event) -> float:
        return other.at_ms - self.at_ms


def test_a_cost_model_has_a_fixed_cost_and_a_cost_per_unit():
    model = CostModel(0.002, 1e-9)  # 2 ms, then 1 GB/s
    assert model.seconds(0) == 0.002 and model.seconds(1e9) == pytest.approx(1.002)
    with pytest.raises(AssertionError, match="not negative"):
        CostModel(-1.0, 0.0)


def test_the_meter_fits_a_line_through_samples_of_two_sizes():
    meter = CostMeter()
    assert meter.model is None
    meter.seed([(1000.0, 0.003), (4000.0, 0.006)])  # 2 ms fixed, 1 us a unit
    assert meter.model.fixed_s == pytest.approx(0.002) and meter.model.per_unit_s == pytest.approx(1e-6)
    assert meter.samples == 0 and meter.last_sample_at is None  # a seed is no sample


def test_samples_of_one_size_fit_a_line_through_the_origin():
    meter = CostMeter()
    meter.add(2000.0, 0.004)
    meter.add(2000.0, 0.004)
    assert meter.model == CostModel(0.0, 2e-6)
    meter.add(0.0, 1.0)  # an empty load is no sample
    meter.add(10.0, 0.0)
    assert meter.samples == 2


def test_recent_samples_move_the_line_and_the_seed_keeps_its_slope():
    clock = Clock()
    meter = CostMeter(keep=0.5, clock=clock)
    meter.seed([(1000.0, 0.003), (4000.0, 0.006)])
    clock.now = 7.0
    for _ in range(6):  # a slow link: 4000 units now take 30 ms (the seed said 6 ms)
        meter.add(4000.0, 0.030)
    model = meter.model
    assert model.seconds(4000) == pytest.approx(0.030, rel=0.15)  # follows the recent samples at their size ...
    assert model.per_unit_s > 0  # ... and still has a slope, from the seed's two sizes
    assert (meter.samples, meter.last_sample_at) == (6, 7.0)


def test_a_line_falling_with_size_is_all_fixed_cost():
    meter = CostMeter()
    meter.seed([(1000.0, 0.010), (4000.0, 0.004)])
    assert (meter.model.fixed_s, meter.model.per_unit_s) == (pytest.approx(0.007), 0.0)


def test_a_cuda_load_counts_to_its_copies_completion():
    assert loaded_seconds(TierLoad("l0", 1, 100, 0.001)) == 0.001  # no events: the host's time
    running = TierLoad("l0", 1, 100, 0.001, (Event(0.0), Event(5.0, done=False)))
    assert loaded_seconds(running) is None  # still copying: asked again later, never waited for
    done = TierLoad("l0", 1, 100, 0.001, (Event(0.0), Event(5.0)))
    assert loaded_seconds(done) == pytest.approx(0.005)  # the copies ran 5 ms after the host issued them in 1
    issued_slowly = TierLoad("l0", 1, 100, 0.009, (Event(0.0), Event(5.0)))
    assert loaded_seconds(issued_slowly) == 0.009


def test_store_tier_names_the_daemons_read_path():
    class Store:
        def __init__(self, mode):
            self.read_mode = mode

    assert [store_tier(Store(mode)) for mode in ("locked_map", "stream", "remote", "")] == [
        "daemon_map", "daemon_fetch", "daemon_fetch", "store"]
    assert store_tier(object()) == "store"
