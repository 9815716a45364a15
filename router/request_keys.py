"""A request's chunk keys, computed as every replica computes them (kvboost_keys, the replicas' tokenizer)."""
from __future__ import annotations

import dataclasses
import logging

from kvboost.v1 import inference_pb2 as pb
from kvboost_keys.namespace import salted_namespace
from kvboost_keys.prompts import PromptPlan, plan_prompt, tokenize_request, tokenize_warm
from router.model_identity import ModelIdentity

logger = logging.getLogger(__name__)


class RequestKeys:
    """Tokenizes and keys requests with the replicas' tokenizer, chunk size and namespace, salted by each
    request's cache_salt exactly as the service salts it (the service's own --tenant-salt is already in the
    namespace its ModelInfo reports)."""

    def __init__(self, tokenizer, identity: ModelIdentity) -> None:
        self.tokenizer = tokenizer
        self.identity = identity

    def for_generate(self, request: pb.GenerateRequest) -> PromptPlan | None:
        """None when there is nothing to key (no prompt, or one the tokenizer refuses): the replica then
        answers with the request's real error."""
        messages = [(message.role, message.content) for message in request.messages]
        return self._plan(request.cache_salt, lambda: tokenize_request(
            self.tokenizer, request.prompt or None, messages or None, list(request.segments) or None))

    def for_warm(self, request: pb.WarmRequest) -> PromptPlan | None:
        """A warm-up's keys, content keys only when it is content-addressed (as the service stores it)."""
        messages = [(message.role, message.content) for message in request.messages]
        plan = self._plan(request.cache_salt, lambda: tokenize_warm(
            self.tokenizer, request.text or None, messages or None, request.content_addressed))
        if plan is None or request.content_addressed:
            return plan
        return dataclasses.replace(plan, content_keys=(None,) * len(plan.prefix_keys))

    def _plan(self, cache_salt: str, tokenize) -> PromptPlan | None:
        try:
            segments = tokenize()
        except Exception as error:  # any refusal is the replica's to report; routing just goes by load
            logger.debug("cannot key a request (%s): routing it by load", error)
            return None
        if not any(segments):
            return None
        namespace = salted_namespace(self.identity.namespace, cache_salt)
        return plan_prompt(namespace, segments, self.identity.chunk_size)
