"""Log-probabilities of chosen tokens and their most likely alternatives, as small pure tensor functions."""
from __future__ import annotations

import torch

# The most alternatives a token may list (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


def chosen_and_top(logits: torch.Tensor, chosen_ids: torch.Tensor, num_top: int
                   ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-softmax in float32 of each row, read at the chosen id and at its num_top best ids.

    logits: [rows, vocab]; chosen_ids: [rows]. Returns (chosen logprob per row, [(id, logprob)] best
    first per row, num_top long).
    """
    assert 0 <= num_top <= MAX_TOP_LOGPROBS, f"num_top must be in 0..{MAX_TOP_LOGPROBS}, got {num_top}"
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    chosen = logprobs.gather(-1, chosen_ids.view(-1, 1).to(logprobs.device)).squeeze(-1)  # [rows]
    top_ids: list[list[int]] = [[] for _ in range(logprobs.shape[0])]
    top_values: list[list[float]] = [[] for _ in range(logprobs.shape[0])]
    if num_top:
        values, ids = torch.topk(logprobs, num_top, dim=-1)  # [rows, num_top], best first
        top_ids, top_values = ids.tolist(), values.tolist()
    return chosen.tolist(), [list(zip(row_ids, row_values)) for row_ids, row_values in zip(top_ids, top_values)]
