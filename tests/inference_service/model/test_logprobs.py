"""chosen_and_top: float32 log-softmax read at the chosen ids and the best alternatives."""
from __future__ import annotations

import math

import pytest
import torch

from inference_service.model.logprobs import chosen_and_top
from inference_service.model.sampling import suppress_tokens


def test_chosen_logprob_and_alternatives_best_first():
    # Row 0: probabilities 1/2, 1/4, 1/4 (logits log 2, 0, 0); row 1: one certain token.
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0], [0.0, 0.0, 100.0]])
    chosen, top = chosen_and_top(logits, torch.tensor([1, 2]), num_top=2)
    assert chosen == pytest.approx([math.log(0.25), 0.0], abs=1e-6)
    assert [token for token, _ in top[0]] == [0, 1]  # ties broken by topk; the best first
    assert top[0][0][1] == pytest.approx(math.log(0.5), abs=1e-6)
    assert top[1][0] == (2, pytest.approx(0.0, abs=1e-6))


def test_no_alternatives_when_none_are_asked_for():
    chosen, top = chosen_and_top(torch.zeros(2, 4), torch.tensor([0, 3]), num_top=0)
    assert chosen == pytest.approx([math.log(0.25)] * 2)
    assert top == [[], []]


def test_half_precision_logits_are_read_in_float32():
    logits = torch.tensor([[3.0, 1.0, -2.0]])
    chosen, _ = chosen_and_top(logits.half(), torch.tensor([0]), 0)
    assert chosen[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item(), abs=1e-3)


def test_suppressed_tokens_cannot_be_chosen():
    logits = torch.tensor([5.0, 1.0, 0.0])
    suppressed = suppress_tokens(logits, frozenset({0}))
    assert suppressed.tolist() == [float("-inf"), 1.0, 0.0]
    assert logits[0] == 5.0  # the input is left as it was
    assert suppress_tokens(logits, frozenset()) is logits
