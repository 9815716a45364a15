"""Batch calls (GenerateBatch, GenerateMany): their requests run on the continuous-batching scheduler.

A call's requests that share leading whole chunks name one SharedPrefix, so those chunks are fetched
from the store (the rest computed) once for all of them; each request then prefills its own suffix (the
suffixes that fit one step together in one forward) and decodes as a row of the running batch. Requests
of a call keep their own mode; baseline requests and CHUNK_KV_REUSE requests with content hits (repair
is per prompt) share nothing. Models with sliding-window layers cannot run in a padded batch: their
requests run one after another through pipeline.generate_one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from inference_service.engine.pipeline import EngineParts, ShouldStop, generate_one, plan_request
from inference_service.engine.prompts import PromptPlan
from inference_service.engine.scheduler import OnDone, SharedPrefix, StreamRequest, run_to_completion
from inference_service.engine.types import GenerationOutcome, GenerationParams
from inference_service.errors import InvalidRequest, PromptTooLong
from inference_service.model.batch_forward import has_sliding_layers
from inference_service.store.protocol import StoreUnavailable


def generate_batch(parts: EngineParts, params_list: Sequence[GenerationParams], should_stop: ShouldStop = lambda: False,
                   pad_token_id: int | None = None) -> list[GenerationOutcome]:
    """Runs the prompts together, their common leading chunks prefilled once; input order kept.

    Raises:
        InvalidRequest: no requests, or one the server does not accept (nothing runs then).
        PromptTooLong: a prompt with more tokens than max_prompt_tokens.
    """
    return _run(parts, params_list, False, should_stop, pad_token_id)


def generate_many(parts: EngineParts, params_list: Sequence[GenerationParams], should_stop: ShouldStop = lambda: False,
                  pad_token_id: int | None = None) -> list[GenerationOutcome]:
    """generate_batch for unrelated prompts: they are grouped by mode and first chunk (prefix key), and each
    group's common leading chunks are prefilled once; input order kept.

    Raises:
        InvalidRequest, PromptTooLong: as generate_batch.
    """
    return _run(parts, params_list, True, should_stop, pad_token_id)


def batch_requests(parts: EngineParts, params_list: Sequence[GenerationParams], by_first_chunk: bool,
                   should_stop: ShouldStop, on_done: OnDone) -> list[StreamRequest]:
    """The call's requests for a scheduler, planned and grouped; on_done(outcomes in input order, None) once
    all have ended, or on_done(None, error) at the first failure (the others then stop).

    by_first_chunk: GenerateMany's grouping (mode and first chunk); otherwise GenerateBatch's (mode).

    Raises:
        InvalidRequest, PromptTooLong: as generate_batch (raised before anything is queued).
    """
    plans = _plan(parts, params_list)
    gathered = _Gathered([None] * len(plans), len(plans), on_done, should_stop)
    requests = [StreamRequest(params, None, gathered.should_stop, gathered.on_done_for(index), parts=parts, mode=mode,
                              prompt=prompt, max_new_tokens=max_new_tokens, label=f" batch row {index}")
                for index, (params, mode, prompt, max_new_tokens) in enumerate(plans)]
    for group in _groups(parts, requests, by_first_chunk):
        num_shared = shared_chunk_count([request.prompt for request in group])
        if len(group) < 2 or num_shared == 0:
            continue
        shared = SharedPrefix.of(group[0].prompt, num_shared, group[0].params.request_id)
        for position, request in enumerate(group):
            request.shared, request.count_fetched = shared, position == 0
    return requests


def shared_chunk_count(prompts: Sequence[PromptPlan]) -> int:
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


def _run(parts: EngineParts, params_list: Sequence[GenerationParams], by_first_chunk: bool, should_stop: ShouldStop,
         pad_token_id: int | None) -> list[GenerationOutcome]:
    if has_sliding_layers(parts.model.config):  # pads would shift the window: one request after another
        _plan(parts, params_list)  # every request is checked before any runs
        return [generate_one(parts, params, should_stop=should_stop)[0] for params in params_list]
    return run_to_completion(parts, lambda on_done: batch_requests(parts, params_list, by_first_chunk, should_stop,
                                                                   on_done), pad_token_id or 0)


def _plan(parts: EngineParts, params_list: Sequence[GenerationParams]) -> list[tuple[GenerationParams, str, PromptPlan, int]]:
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


def _groups(parts: EngineParts, requests: list[StreamRequest], by_first_chunk: bool) -> list[list[StreamRequest]]:
    """Requests that may share a prefix, in input order; baseline and content-hit requests share nothing."""
    groups: dict[tuple[str, bytes | None], list[StreamRequest]] = {}
    for request in requests:
        if request.mode == "baseline" or _has_content_hits(parts, request):
            continue
        key = (request.mode, _first_shareable_key(request.prompt) if by_first_chunk else None)
        groups.setdefault(key, []).append(request)
    return list(groups.values())


def _first_shareable_key(prompt: PromptPlan) -> bytes | None:
    chunks = prompt.chunks.chunks
    return prompt.prefix_keys[0] if chunks and chunks[0].end < prompt.num_tokens else None


def _has_content_hits(parts: EngineParts, request: StreamRequest) -> bool:
    if request.mode != "chunk_kv_reuse":
        return False
    prompt = request.prompt
    try:
        lookup = parts.store.lookup(parts.namespace, list(prompt.prefix_keys), list(prompt.content_keys))
    except StoreUnavailable:
        return False  # served without the cache, as a single request would be
    return bool(lookup.content_hits)

