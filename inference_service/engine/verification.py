"""Compares a cached mode with BASELINE: token identity and first-token logit agreement."""
from __future__ import annotations

import torch

_PASSAGE = (
    "The lighthouse keeper wrote in the logbook every evening. The wind came from the north-west, "
    "the sea was rough, and three fishing boats returned to the harbour before sunset. The lamp was "
    "cleaned, the clockwork wound, and the fog horn tested twice. Supplies arrived by boat on Tuesdays: "
    "flour, lamp oil, coffee, letters and the newspaper from the mainland. "
)
# Long enough to span several chunks at the default chunk size, so the second run has prefix hits.
BUILTIN_PROMPTS = (
    _PASSAGE * 4 + "Question: on which day did supplies arrive? Answer:",
    _PASSAGE * 4 + "Question: what was tested twice? Answer:",
    "Write a short poem about the sea.\n" + _PASSAGE * 3 + "Poem:",
)


def first_token_cosine(baseline: torch.Tensor, cached: torch.Tensor) -> float:
    """Cosine similarity of two logit vectors [vocab]."""
    return float(torch.nn.functional.cosine_similarity(baseline.double(), cached.double(), dim=0))


def first_token_kl(baseline: torch.Tensor, cached: torch.Tensor) -> float:
    """KL(baseline || cached) of the softmax distributions of two logit vectors [vocab], in nats."""
    baseline_log = torch.log_softmax(baseline.double(), dim=-1)
    cached_log = torch.log_softmax(cached.double(), dim=-1)
    return float(torch.sum(baseline_log.exp() * (baseline_log - cached_log)).clamp_min(0.0))


def matching_prefix_tokens(first: list[int], second: list[int]) -> int:
    """How many tokens agree before the first difference."""
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count
