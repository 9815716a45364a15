"""Log-probabilities as the engine returns them: the model room's numbers with each token's decoded text."""
from __future__ import annotations

from typing import Sequence

import torch

from inference_service.engine_parts.types import TokenLogprob, TopLogprob
from inference_service.model.logprobs import chosen_and_top


def token_text(tokenizer, token_id: int) -> str:
    """The token alone, decoded (special tokens kept, so an EOS reads as itself)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_logprobs(tokenizer, logits: torch.Tensor, chosen_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """One TokenLogprob per row of logits ([rows, vocab]), read at chosen_ids[row]."""
    chosen, top = chosen_and_top(logits, torch.tensor(list(chosen_ids)), num_top)
    return [
        TokenLogprob(token_id, token_text(tokenizer, token_id), logprob,
                     tuple(TopLogprob(top_id, token_text(tokenizer, top_id), top_logprob)
                           for top_id, top_logprob in alternatives))
        for token_id, logprob, alternatives in zip(chosen_ids, chosen, top)
    ]


def prompt_logprobs(tokenizer, logits: torch.Tensor, prompt_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Every prompt token's logprob from the prompt's own logits ([tokens, vocab], row i predicting token i + 1).

    The first token has none (nothing before it predicts it).
    """
    first = TokenLogprob(prompt_ids[0], token_text(tokenizer, prompt_ids[0]), None)
    if len(prompt_ids) == 1:
        return [first]
    return [first] + token_logprobs(tokenizer, logits[:-1], prompt_ids[1:], num_top)
