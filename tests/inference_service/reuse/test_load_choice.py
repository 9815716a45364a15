"""The load-or-recompute choice per request: predicted times with fixed costs, a prefix of the run by tier, probes."""
from __future__ import annotations

import pytest

from inference_service.reuse.load_choice import LoadChooser, RunPart, best_load, predicted_seconds
from inference_service.kv_memory.tier_rates import CostModel, TierLoad
from tests.inference_service.kv_memory.test_tier_rates import Clock, Event

PER_TOKEN = 1000  # K/V bytes of one token
PREFILL = CostModel(0.010, 50e-6)  # 10 ms, then 50 us a token
DAEMON = CostModel(0.020, 1e-8)  # 20 ms (Lookup, Fetch), then 10 us a token's 1000 bytes
L0 = CostModel(0.0001, 1e-11)  # 0.1 ms, then 0.01 us a token
# Loading n tokens from the daemon costs 20 ms + 10 us n, recomputing them 50 us n: they break even at 500 tokens.


@pytest.mark.parametrize("run_tokens, loads", [(256, False), (499, False), (500, True), (768, True)])
def test_below_the_break_even_length_the_run_is_recomputed(run_tokens, loads):
    choice = best_load([RunPart("daemon_map", run_tokens)], 24, PER_TOKEN, {"daemon_map": DAEMON}, PREFILL)
    assert (choice.num_parts, choice.num_tokens) == ((1, run_tokens) if loads else (0, 0))
    assert choice.recompute_s == pytest.approx(PREFILL.seconds(run_tokens + 24))
    assert choice.predicted_s == pytest.approx(min(PREFILL.seconds(run_tokens + 24),
                                                   DAEMON.seconds(run_tokens * PER_TOKEN) + PREFILL.seconds(24)))


def test_a_prefix_of_the_run_is_loaded_when_its_tail_loads_slower():
    parts = [RunPart("l0", 256), RunPart("daemon_map", 384)]
    loads = {"l0": L0, "daemon_map": DAEMON}
    # L0's 256 tokens: 0.1 ms to load, 12.8 ms to recompute; the daemon's 384: 23.8 ms to load, 19.2 ms to recompute.
    choice = best_load(parts, 24, PER_TOKEN, loads, PREFILL)
    assert (choice.num_parts, choice.num_tokens) == (1, 256)
    assert choice.predicted_s == pytest.approx(L0.seconds(256 * PER_TOKEN) + PREFILL.seconds(384 + 24))
    # A longer daemon part is past break-even: all of it loads.
    assert best_load([parts[0], RunPart("daemon_map", 1024)], 24, PER_TOKEN, loads, PREFILL).num_parts == 2


def test_each_tier_pays_its_fixed_cost_once():
    parts = [RunPart("l0", 128), RunPart("host", 128), RunPart("l0", 128)]
    loads = {"l0": L0, "host": CostModel(0.001, 0.0)}
    assert predicted_seconds(parts, 3, 8, PER_TOKEN, loads, PREFILL) == pytest.approx(
        L0.seconds(256 * PER_TOKEN) + 0.001 + PREFILL.seconds(8))


def test_what_is_not_measured_is_loaded():
    # A tier with no model costs nothing: it is tried, and its load measured.
    assert best_load([RunPart("daemon_fetch", 64)], 8, PER_TOKEN, {}, PREFILL).num_parts == 1
    # No prefill model: nothing to compare with, the whole run loads.
    choice = best_load([RunPart("daemon_map", 64)], 8, PER_TOKEN, {"daemon_map": DAEMON}, None)
    assert (choice.num_parts, choice.recompute_s) == (1, float("inf"))


def seeded_chooser(clock: Clock) -> LoadChooser:
    chooser = LoadChooser(probe_interval_s=30.0, clock=clock)
    chooser.prefill.seed([(100, PREFILL.seconds(100)), (400, PREFILL.seconds(400))])
    chooser.load_meter("daemon_map").seed([(n * PER_TOKEN, DAEMON.seconds(n * PER_TOKEN)) for n in (128, 512)])
    return chooser


def test_a_skipped_tier_is_probed_now_and_then_and_its_new_samples_decide():
    clock = Clock()
    chooser = seeded_chooser(clock)
    run = [RunPart("daemon_map", 256)]
    # t=0: the seed says 256 tokens recompute faster (22.8 ms to load, 12.8 ms to recompute); the probe clock starts.
    assert chooser.choose(run, 24, PER_TOKEN).num_parts == 0
    clock.now = 29.0  # not yet due
    assert chooser.choose(run, 24, PER_TOKEN).num_parts == 0
    clock.now = 30.0  # due: loaded once to be measured again, the probe named
    probe = chooser.choose(run, 24, PER_TOKEN)
    assert (probe.num_parts, probe.probe) == (1, ("daemon_map",))
    assert chooser.choose(run, 24, PER_TOKEN).num_parts == 0  # the next request: the probe's clock restarted
    for _ in range(3):  # the probe's loads: the daemon answers 256 tokens in 1 ms now (a warm map, a quiet host)
        chooser.load_meter("daemon_map").add(256 * PER_TOKEN, 0.001)
    assert chooser.choose(run, 24, PER_TOKEN).num_parts == 1
    clock.now = 100.0  # loaded and measured on every request: no probe is ever due
    assert chooser.choose(run, 24, PER_TOKEN).probe == ()


def test_engine_stats_count_skips_and_probes_and_take_cuda_loads_once_their_copies_completed():
    from inference_service.engine_parts.counters import EngineStats
    stats = EngineStats()
    clock = Clock()
    stats.chooser = seeded_chooser(clock)
    assert stats.choose_load([RunPart("daemon_map", 256)], 24, PER_TOKEN).num_parts == 0
    clock.now = 30.0
    assert stats.choose_load([RunPart("daemon_map", 256)], 24, PER_TOKEN).probe == ("daemon_map",)
    snapshot = stats.snapshot()
    assert (snapshot["loads_skipped"], snapshot["load_skipped_tokens"], snapshot["load_probes"]) == (1, 256, 1)
    # A CUDA load reported while its copies still run reaches the model only once they completed.
    copying = Event(3.0, done=False)
    stats.add_tier_load(TierLoad("l0", 2, 256 * PER_TOKEN, 0.0005, (Event(0.0), copying)))
    assert stats.chooser.load_meter("l0").samples == 0
    copying.done = True
    stats.add_tier_load(TierLoad("l0", 1, 128 * PER_TOKEN, 0.0002))  # the next report takes the finished one too
    assert stats.chooser.load_meter("l0").samples == 2
    assert stats.snapshot()["tier_loads"]["l0"] == {"chunks": 3, "bytes": 384 * PER_TOKEN, "seconds": 0.0007,
                                                    "loads": 2}
