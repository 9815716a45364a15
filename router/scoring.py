"""How much of a request's prompt a replica would reuse, and what the request would cost there (pure)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvboost_keys.prompts import PromptPlan

Holds = Callable[[bytes], bool]


@dataclass(slots=True, frozen=True)
class ReuseEstimate:
    exact_tokens: int  # the leading run of whole chunks, plus a stored partial chunk that continues it
    content_tokens: int  # chunks after that, held under their content key: reused, then repaired

    def __post_init__(self) -> None:
        assert self.exact_tokens >= 0 and self.content_tokens >= 0, f"token counts must be >= 0: {self}"


@dataclass(slots=True, frozen=True)
class CostWeights:
    """What the prefix policy trades: prefill saved by the cache against the work already waiting."""

    # A content hit saves this share of its tokens' prefill: repair recomputes part of it, and the guard may
    # recompute all of it.
    content_weight: float = 0.5
    # Prompt tokens of prefill that one running or queued request is worth: a replica holding a document's
    # ~1.6k tokens still wins until it has about six more requests than an empty one.
    load_cost_tokens: float = 256.0

    def __post_init__(self) -> None:
        assert 0.0 <= self.content_weight <= 1.0, f"content_weight must be in [0, 1], got {self.content_weight}"
        assert self.load_cost_tokens >= 0.0, f"load_cost_tokens must be >= 0, got {self.load_cost_tokens}"


def estimate_reuse(plan: PromptPlan, holds_prefix: Holds, holds_content: Holds | None) -> ReuseEstimate:
    """The tokens a replica whose daemon holds these keys would take from its cache, as its own lookup would:
    prefix keys in order until the first miss, the longest stored partial chunk after them, then content hits
    (holds_content None: the request's mode reuses exact prefixes only)."""
    chunks = plan.chunks.chunks
    run = 0
    while run < len(plan.prefix_keys) and holds_prefix(plan.prefix_keys[run]):
        run += 1
    exact = sum(len(chunk.token_ids) for chunk in chunks[:run])
    _, partial_keys = plan.partial_candidates(run)  # longest first
    partial = next((len(partial_keys) - rank for rank, key in enumerate(partial_keys) if holds_prefix(key)), 0)
    if holds_content is None:
        return ReuseEstimate(exact + partial, 0)
    after = run + (1 if partial else 0)  # a chunk partly reused exactly is not also a content hit
    content = sum(len(chunk.token_ids) for chunk, key in zip(chunks[after:], plan.content_keys[after:])
                  if key and holds_content(key))
    return ReuseEstimate(exact + partial, content)


def expected_cost(num_tokens: int, reuse: ReuseEstimate, load: int, weights: CostWeights) -> float:
    """Prompt tokens left to compute (content hits at their weight), plus the replica's load in the same unit."""
    computed = num_tokens - reuse.exact_tokens - weights.content_weight * reuse.content_tokens
    return computed + weights.load_cost_tokens * load
