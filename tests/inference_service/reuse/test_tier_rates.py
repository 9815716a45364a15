"""Per-tier loads and the choice between loading a prefix and recomputing it, by measured rates."""
from __future__ import annotations

import pytest

from inference_service.reuse.tier_rates import RateMeter, load_is_slower, store_tier

PER_TOKEN = 131_072  # K/V bytes of one token of an 8B-shaped model in bf16


@pytest.mark.parametrize("load_gb_s, prefill_tokens_s, slower", [
    (40.0, 16_000.0, False),  # a host tier at 40 GB/s: 305k tokens/s of K/V against 16k tokens/s prefilled
    (1.0, 16_000.0, True),  # a slow link: 7.6k tokens/s of K/V, prefill is faster
    (2.097152, 16_000.0, False),  # exactly as fast: load (it spares the device's compute)
    (None, 16_000.0, False),  # nothing measured yet: the cache is tried, and measured
    (1.0, None, False),
])
def test_load_is_slower_compares_the_measured_rates(load_gb_s, prefill_tokens_s, slower):
    load = load_gb_s * 1e9 if load_gb_s else None
    assert load_is_slower(2048, PER_TOKEN, load, prefill_tokens_s) is slower
    assert load_is_slower(0, PER_TOKEN, load, prefill_tokens_s) is False


def test_the_rate_meter_follows_recent_samples():
    meter = RateMeter(keep=0.5)
    assert meter.rate is None
    meter.add(100.0, 1.0)
    assert meter.rate == 100.0
    meter.add(10.0, 1.0)  # a slower sample: (50 + 10) / (0.5 + 1)
    assert meter.rate == pytest.approx(40.0)
    meter.add(0.0, 1.0)  # an empty load is no sample
    assert meter.rate == pytest.approx(40.0)


def test_store_tier_names_the_daemons_read_path():
    class Store:
        def __init__(self, mode):
            self.read_mode = mode

    assert [store_tier(Store(mode)) for mode in ("locked_map", "stream", "remote", "")] == [
        "daemon_map", "daemon_fetch", "daemon_fetch", "store"]
    assert store_tier(object()) == "store"
