"""Compares a cached mode with BASELINE: token identity and first-token logit agreement."""
from __future__ import annotations

from typing import Callable, Sequence

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


def compare_modes(run: Callable[[str, str], tuple], flush_writes: Callable[[], None], prompts: Sequence[str],
                  mode: str) -> list[dict]:
    """Per prompt, BASELINE against `mode` (run twice, so the second run has hits), as report rows.

    run(prompt, mode) -> (outcome, first-token logits). Compares our own modes with each other (its job);
    identity with plain transformers `model.generate` is checked by the test suite, never by this.
    """
    reports = []
    for prompt in prompts:
        baseline, baseline_logits = run(prompt, "baseline")
        run(prompt, mode)
        flush_writes()
        cached, cached_logits = run(prompt, mode)
        reports.append({
            "prompt": prompt,
            "token_identical": baseline.output_token_ids == cached.output_token_ids,
            "first_token_cosine": first_token_cosine(baseline_logits, cached_logits),
            "first_token_kl": first_token_kl(baseline_logits, cached_logits),
            "matching_prefix_tokens": matching_prefix_tokens(baseline.output_token_ids, cached.output_token_ids),
            "cached_tokens": cached.cached_tokens,
            "baseline_text": baseline.output_text,
            "cached_text": cached.output_text,
        })
    return reports
