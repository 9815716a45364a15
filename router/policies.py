"""The routing policies: each ranks the healthy replicas, best first; the rest of the ranking is where a failed
request is retried (pure)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

POLICIES = ("prefix", "least-loaded", "round-robin")


@dataclass(slots=True, frozen=True)
class Candidate:
    index: int  # the replica's position among --replica flags
    load: int  # running + queued there, this router's in-flight requests included
    num_routed: int  # requests this router sent there so far: equal candidates go to the one that had fewer
    cost: float = 0.0  # the prefix policy's expected cost (scoring.expected_cost)


def rank(policy: str, candidates: Sequence[Candidate], turn: int) -> list[int]:
    """Replica indices, best first.

    turn: how many requests round-robin has placed so far; it starts its ranking at that candidate (in index
    order), so the healthy replicas take turns evenly.
    """
    assert policy in POLICIES, f"policy must be one of {POLICIES}, got {policy!r}"
    assert candidates, "rank needs at least one candidate"
    if policy == "round-robin":
        by_index = sorted(candidates, key=lambda c: c.index)
        start = turn % len(by_index)
        ordered = by_index[start:] + by_index[:start]
    elif policy == "least-loaded":
        ordered = sorted(candidates, key=lambda c: (c.load, c.num_routed, c.index))
    else:
        ordered = sorted(candidates, key=lambda c: (c.cost, c.load, c.num_routed, c.index))
    return [candidate.index for candidate in ordered]
