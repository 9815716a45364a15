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


def test_skip_load_needs_three_samples_of_each_rate_and_counts_what_it_skips():
    from inference_service.request.counters import EngineStats
    counters = EngineStats()
    counters.add_request(prompt_tokens=1024, cached_tokens=0, recomputed_tokens=0, chunks_fetched=0,
                         bytes_fetched=0, ttft_ms=100.0)  # 10,240 tokens a second prefilled
    counters.add_request(prompt_tokens=100, cached_tokens=0, recomputed_tokens=0, chunks_fetched=0,
                         bytes_fetched=0, ttft_ms=1.0)  # too short to be a rate: not a sample
    for _ in range(2):
        counters.add_tier_load("daemon_fetch", 1, 1_000_000, 1.0)  # 1 MB/s: 7.6 tokens a second of 131 KiB
    assert not counters.skip_load("daemon_fetch", 2048, PER_TOKEN)  # one prefill sample, two load samples
    for _ in range(2):
        counters.add_request(1024, 0, 0, 0, 0, 100.0)
    counters.add_tier_load("daemon_fetch", 1, 1_000_000, 1.0)
    assert counters.skip_load("daemon_fetch", 2048, PER_TOKEN)
    assert not counters.skip_load("l0", 2048, PER_TOKEN)  # never measured
    assert (counters.snapshot()["loads_skipped"], counters.snapshot()["load_skipped_tokens"]) == (1, 2048)
