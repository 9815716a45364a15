"""A request's chunk keys, computed as every replica computes them (kvboost_keys, the replicas' tokenizer)."""
from __future__ import annotations

import dataclasses
import logging

from kvboost.v1 import inference_pb2 as pb
from kvboost_keys.namespace import salted_namespace
from kvboost_keys.prompts import PromptPlan, plan_prompt, tokenize_request, tokenize_warm
from kvboost_keys.token_cache import DEFAULT_TOKEN_CACHE_BYTES, TokenCache, token_cache_for
from router.model_identity import ModelIdentity

logger = logging.getLogger(__name__)


class RequestKeys:
    """Tokenizes and keys requests with the replicas' tokenizer, chunk size and namespace, salted by each
    request's cache_salt exactly as the service salts it (the service's own --tenant-salt is already in the
    namespace its ModelInfo reports)."""

    def __init__(self, tokenizer, identity: ModelIdentity, token_cache_bytes: int = DEFAULT_TOKEN_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.identity = identity
        # Long pieces of prompt text seen before are not tokenized again (the service's cache, the same ids).
        self.token_cache: TokenCache | None = token_cache_for(tokenizer, token_cache_bytes)

    def for_generate(self, request: pb.GenerateRequest) -> PromptPlan | None:
        """None when there is nothing to key (no prompt, or one the tokenizer refuses): the replica then
        answers with the request's real error."""
        messages = [(message.role, message.content) for message in request.messages]
        return self._plan(request.cache_salt, lambda scope: tokenize_request(
            self.tokenizer, request.prompt or None, messages or None, list(request.segments) or None,
            self.token_cache, scope))

    def for_warm(self, request: pb.WarmRequest) -> PromptPlan | None:
        """A warm-up's keys, content keys only when it is content-addressed (as the service stores it)."""
        messages = [(message.role, message.content) for message in request.messages]
        plan = self._plan(request.cache_salt, lambda scope: tokenize_warm(
            self.tokenizer, request.text or None, messages or None, request.content_addressed, self.token_cache,
            scope))
        if plan is None or request.content_addressed:
            return plan
        return dataclasses.replace(plan, content_keys=(None,) * len(plan.prefix_keys))

    def _plan(self, cache_salt: str, tokenize) -> PromptPlan | None:
        """tokenize(scope): the request's segments, its texts' cached pieces scoped by its salted namespace."""
        namespace = salted_namespace(self.identity.namespace, cache_salt)
        try:
            segments = tokenize(namespace)
        except Exception as error:  # any refusal is the replica's to report; routing just goes by load
            logger.debug("cannot key a request (%s): routing it by load", error)
            return None
        if not any(segments):
            return None
        return plan_prompt(namespace, segments, self.identity.chunk_size)
