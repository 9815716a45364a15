"""Start-up calibration: the choice's cost lines seeded on the served model's shapes before the first request."""
from __future__ import annotations

from inference_service.reuse.load_choice import RunPart
from tests.inference_service.engine.test_engine import make_engine, reference_ids, run, text_of_length
from kvboost_keys.prompts import tokenize_prompt


def test_with_the_choice_on_every_cost_line_is_measured_before_the_first_request(tiny_llama):
    engine = make_engine(tiny_llama, recompute_when_faster=True)
    try:
        points = engine.calibration.points
        assert sorted(points) == ["l0", "prefill", "store"]  # no host tier on a CPU
        assert [units for units, _ in points["prefill"]] == [8, 32]  # 1 and 4 chunks of 8 tokens
        assert [units for units, _ in points["store"]] == [8 * 512, 64 * 512]  # 1 and 8 chunks, 512 B a token
        assert all(seconds > 0 for line in points.values() for _, seconds in line)
        models = engine.parts.counters.chooser.models()
        assert all(models[name] is not None for name in ("prefill", "l0", "store"))
        assert engine.parts.counters.chooser.prefill.samples == 0  # seeded, no request measured yet
        # The first request is chosen on those lines (whatever they say here), and stays exact.
        choice = engine.parts.counters.choose_load([RunPart("store", 64)], 8, 512)
        assert choice.recompute_s != float("inf")
        prompt = text_of_length(40)
        expected = reference_ids(tiny_llama[0], tokenize_prompt(tiny_llama[1], prompt)[0])
        assert run(engine, prompt=prompt).output_token_ids == run(engine, prompt=prompt).output_token_ids == expected
    finally:
        engine.close()


def test_with_the_choice_off_nothing_is_measured(tiny_llama):
    engine = make_engine(tiny_llama, recompute_when_faster=False)
    try:
        assert engine.calibration is None
        assert engine.parts.counters.chooser.models() == {"prefill": None}
    finally:
        engine.close()
