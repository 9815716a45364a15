"""Sampling functions: exact filters, greedy ties, seeded reproducibility."""
from __future__ import annotations

import math

import torch

from inference_service.model.sampling import greedy, make_generator, sample, top_k_filter, top_p_filter

INF = float("-inf")


def test_greedy_takes_the_first_maximum():
    assert int(greedy(torch.tensor([1.0, 3.0, 3.0, 2.0]))) == 1


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert top_k_filter(logits, 2).tolist() == [INF, 4.0, 3.0, INF]
    assert top_k_filter(logits, 0).tolist() == logits.tolist()  # off
    assert top_k_filter(logits, 10).tolist() == logits.tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the first two stay.
    kept = top_p_filter(logits, 0.7)
    assert [math.isinf(v) for v in kept.tolist()] == [False, False, True, True]
    # Unsorted input: the filter works on probability rank, not on index.
    shuffled = top_p_filter(logits[[2, 0, 3, 1]], 0.7)
    assert [math.isinf(v) for v in shuffled.tolist()] == [True, False, True, False]
    # The top token always stays, even for a tiny p.
    assert not math.isinf(top_p_filter(logits, 0.01)[0].item())
    assert top_p_filter(logits, 1.0).tolist() == logits.tolist()


def test_zero_temperature_is_greedy():
    logits = torch.tensor([0.1, 0.2, 5.0, 0.3])
    assert int(sample(logits, 0.0)) == 2


def test_sampling_follows_the_seed():
    logits = torch.zeros(1000)

    def draws(seed: int) -> list[int]:
        generator = make_generator(seed)
        return [int(sample(logits, 1.0, generator=generator)) for _ in range(20)]

    assert draws(1) == draws(1) != draws(2)


def test_sampling_never_picks_a_filtered_token():
    logits = torch.tensor([2.0, 1.9, -5.0, -5.0, 1.8])
    generator = make_generator(0)
    picks = {int(sample(logits, 1.5, top_k=2, generator=generator)) for _ in range(200)}
    assert picks == {0, 1}


def test_unseeded_generators_differ():
    first, second = make_generator(None), make_generator(None)
    assert first.initial_seed() != second.initial_seed()
