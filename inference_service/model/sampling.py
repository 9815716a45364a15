"""Next-token choice as small pure tensor functions: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    # logits: [vocab] -> [] (the first maximum, as torch.argmax and model.generate pick it)
    return torch.argmax(logits, dim=-1)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keeps the top_k largest logits (ties at the threshold kept); 0 = off."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps the smallest set of tokens whose probabilities sum to at least top_p (the top token always)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_ids = torch.sort(logits, descending=True, dim=-1)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # A token is dropped when the tokens ranked before it already reach top_p.
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop = torch.empty_like(drop_sorted).scatter_(-1, sorted_ids, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def suppress_tokens(logits: torch.Tensor, token_ids: frozenset[int]) -> torch.Tensor:
    """The logits with token_ids made impossible (-inf); logits: [vocab] or [rows, vocab]."""
    if not token_ids:
        return logits
    index = torch.tensor(sorted(token_ids), device=logits.device)
    return logits.index_fill(-1, index, float("-inf"))


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id from logits: [vocab] -> []. temperature 0 means greedy."""
    if temperature <= 0.0:
        return greedy(logits)
    scaled = logits.float() / temperature
    scaled = top_p_filter(top_k_filter(scaled, top_k), top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with seed, or from the OS when seed is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
