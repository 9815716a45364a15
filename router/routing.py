"""Where a request goes: the policy's ranking of the healthy replicas, scored from their daemons' holdings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvboost.v1 import inference_pb2 as pb
from kvboost_keys.prompts import PromptPlan
from router.policies import Candidate, rank
from router.replicas import Replica
from router.scoring import CostWeights, ReuseEstimate, estimate_reuse, expected_cost


@dataclass(slots=True, frozen=True)
class Route:
    """Replicas to try, best first: a request that fails before its first token goes to the second."""

    replicas: tuple[Replica, ...]


class Router:
    """Ranks replicas per request with one policy; keeps round-robin's turn and the reuse it expected."""

    def __init__(self, replicas: Sequence[Replica], policy: str, weights: CostWeights = CostWeights(),
                 cache_tenant: str = "") -> None:
        self.replicas = list(replicas)
        self.policy = policy
        self.weights = weights
        self.cache_tenant = cache_tenant or None  # None: any tenant's chunks count
        self._turn = 0
        self.num_expected_exact_tokens = 0  # reuse expected on the replicas chosen, summed (metrics)
        self.num_expected_content_tokens = 0

    @property
    def keys_requests(self) -> bool:
        """Only the prefix policy looks at a request's keys (the others need no tokenizing)."""
        return self.policy == "prefix"

    def route(self, plans: Sequence[PromptPlan | None] = (), mode: int = pb.MODE_UNSPECIFIED) -> Route:
        """The ranking for a request (one plan) or a batch (a plan per request, all sent to one replica).

        With no replica healthy every replica is ranked: the health read may be stale, and a call that fails
        still fails with the replica's own status.
        """
        candidates = [replica for replica in self.replicas if replica.healthy] or self.replicas
        estimates = {replica.index: self._estimate(replica, plans, mode) for replica in candidates}
        num_tokens = sum(plan.num_tokens for plan in plans if plan is not None)
        ranked = rank(self.policy, [
            Candidate(replica.index, replica.load, replica.num_routed,
                      expected_cost(num_tokens, estimates[replica.index], replica.load, self.weights))
            for replica in candidates], self._turn)
        self._turn += 1
        best = estimates[ranked[0]]
        self.num_expected_exact_tokens += best.exact_tokens
        self.num_expected_content_tokens += best.content_tokens
        return Route(tuple(self.replicas[index] for index in ranked))

    def _estimate(self, replica: Replica, plans: Sequence[PromptPlan | None], mode: int) -> ReuseEstimate:
        """The reuse a replica would give these plans in the request's mode (the replica's default mode where the
        request names none): none from a degraded replica (its daemon is out of reach) or in BASELINE mode; content
        hits only in CHUNK_KV_REUSE mode."""
        mode = mode or replica.default_mode
        if replica.degraded or mode == pb.BASELINE:
            return ReuseEstimate(0, 0)
        tenant = self.cache_tenant
        holdings = replica.holdings

        def holds_prefix(key: bytes) -> bool:
            return holdings.holds_prefix(key, tenant)

        def holds_content(key: bytes) -> bool:
            return holdings.holds_content(key, tenant)

        exact = content = 0
        for plan in plans:
            if plan is not None:
                found = estimate_reuse(plan, holds_prefix, holds_content if mode == pb.CHUNK_KV_REUSE else None)
                exact, content = exact + found.exact_tokens, content + found.content_tokens
        return ReuseEstimate(exact, content)
