"""Batch calls (GenerateBatch, GenerateMany): their requests run as sequences of the one step loop.

A call's requests that share leading whole chunks share one prefill of them: the first of them (the source)
looks them up and computes what is missing; the others (followers) copy those K/V from its slot instead of
their own lookup, then prefill their own suffix (short suffixes together in one forward). Requests of a call
keep their own mode; baseline requests and CHUNK_KV_REUSE requests with content hits (repair is per prompt)
share nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

from inference_service.engine_parts.planning import EngineParts, ShouldStop, plan_request
from kvboost_keys.prompts import PromptPlan
from inference_service.engine.request import OnDone, EngineRequest
from inference_service.engine_parts.types import GenerationOutcome, GenerationParams
from inference_service.errors import InvalidRequest, PromptTooLong
from inference_service.store.protocol import StoreUnavailable


def batch_sequences(parts: EngineParts, params_list: Seq[GenerationParams], by_first_chunk: bool,
                    should_stop: ShouldStop, on_done: OnDone) -> list[EngineRequest]:
    """The call's requests as sequences, planned and grouped; on_done(outcomes in input order, None) once all have
    ended, or on_done(None, error) at the first failure (the others then stop).

    by_first_chunk: GenerateMany's grouping (mode and first chunk); otherwise GenerateBatch's (mode).

    Raises:
        InvalidRequest, PromptTooLong: a request the server does not accept (raised before anything is queued).
    """
    plans = _plan(parts, params_list)
    gathered = _Gathered([None] * len(plans), len(plans), on_done, should_stop)
    seqs = [EngineRequest(params, None, gathered.should_stop, gathered.on_done_for(index), parts=parts, mode=mode,
                     prompt=prompt, max_new_tokens=max_new_tokens, label=f" batch row {index}")
            for index, (params, mode, prompt, max_new_tokens) in enumerate(plans)]
    for group in _groups(parts, seqs, by_first_chunk):
        num_shared = shared_chunk_count([seq.prompt for seq in group])
        if len(group) < 2 or num_shared == 0:
            continue
        source, stored = group[0], set()
        source.followers, source.stored_keys = group[1:], stored
        for follower in group[1:]:
            follower.source, follower.stored_keys, follower.count_fetched = source, stored, False
            follower.num_shared_chunks = num_shared
            follower.num_shared_tokens = source.prompt.chunks.chunks[num_shared - 1].end
    return seqs


def shared_chunk_count(prompts: Seq[PromptPlan]) -> int:
    """Leading chunks whose prefix keys are equal in every prompt, leaving each prompt at least one token to run."""
    first = prompts[0]
    last_start = min(prompt.num_tokens for prompt in prompts) - 1
    count = 0
    for index, (chunk, key) in enumerate(zip(first.chunks.chunks, first.prefix_keys)):
        if chunk.end > last_start or any(
                index >= len(prompt.prefix_keys) or prompt.prefix_keys[index] != key for prompt in prompts):
            break
        count += 1
    return count


@dataclass(slots=True)
class _Gathered:
    """The outcomes of one call's requests, handed on once."""

    outcomes: list
    num_open: int
    on_done: OnDone
    outer_should_stop: ShouldStop
    failed: bool = False

    def should_stop(self) -> bool:
        return self.failed or self.outer_should_stop()

    def on_done_for(self, index: int) -> OnDone:
        def on_request_done(outcomes: list[GenerationOutcome] | None, error: BaseException | None) -> None:
            if self.failed:
                return
            if error is not None:
                self.failed = True
                self.on_done(None, error)
                return
            self.outcomes[index] = outcomes[0]
            self.num_open -= 1
            if self.num_open == 0:
                self.on_done(self.outcomes, None)
        return on_request_done


def _plan(parts: EngineParts, params_list: Seq[GenerationParams]) -> list[tuple[GenerationParams, str, PromptPlan, int]]:
    if not params_list:
        raise InvalidRequest("a batch needs at least one request")
    plans = []
    for index, params in enumerate(params_list):
        try:
            _require_batchable(params)
            plans.append((params, *plan_request(parts, params)))
        except InvalidRequest as error:
            raise InvalidRequest(f"requests[{index}]: {error}") from None
        except PromptTooLong as error:
            named = PromptTooLong(error.num_tokens, error.max_tokens)
            named.args = (f"requests[{index}]: {error}",)
            raise named from None
    return plans


def _require_batchable(params: GenerationParams) -> None:
    """Batch rows take the fields every row's decode step handles; the rest need Generate."""
    unsupported = [name for name, used in (("n", params.n > 1), ("logprobs", params.logprobs is not None),
                                           ("prompt_logprobs", params.prompt_logprobs is not None),
                                           ("min_tokens", params.min_tokens > 0),
                                           ("cache_salt", bool(params.cache_salt))) if used]
    if unsupported:
        raise InvalidRequest(f"batches do not take {', '.join(unsupported)}; send such a request with Generate")


def _groups(parts: EngineParts, requests: list[EngineRequest], by_first_chunk: bool) -> list[list[EngineRequest]]:
    """Requests that may share a prefix, in input order; baseline and content-hit requests share nothing."""
    groups: dict[tuple[str, bytes | None], list[EngineRequest]] = {}
    for request in requests:
        if request.mode == "baseline" or _has_content_hits(parts, request):
            continue
        key = (request.mode, _first_shareable_key(request.prompt) if by_first_chunk else None)
        groups.setdefault(key, []).append(request)
    return list(groups.values())


def _first_shareable_key(prompt: PromptPlan) -> bytes | None:
    chunks = prompt.chunks.chunks
    return prompt.prefix_keys[0] if chunks and chunks[0].end < prompt.num_tokens else None


def _has_content_hits(parts: EngineParts, request: EngineRequest) -> bool:
    if request.mode != "chunk_kv_reuse":
        return False
    prompt = request.prompt
    try:
        lookup = parts.store.lookup(parts.namespace, list(prompt.prefix_keys), list(prompt.content_keys))
    except StoreUnavailable:
        return False  # served without the cache, as a single request would be
    return bool(lookup.content_hits)

