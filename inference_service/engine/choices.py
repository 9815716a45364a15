"""n completions of one prompt: one prefill (cache reuse included), then n rows of the running batch.

The scheduler prefills the prompt once and adds its K/V as n rows; each row samples its first token from
the same prefill logits with its own generator (seed + row) and leaves the batch as it finishes; events
carry the row's index. Models with sliding-window layers cannot use the batch layout: their choices run
one after another (each its own prefill), as separate requests would.
"""
from __future__ import annotations

import dataclasses

from inference_service.engine.generation import OnToken
from inference_service.engine.pipeline import EngineParts, ShouldStop, generate_one
from inference_service.engine.scheduler import StreamRequest, run_to_completion
from inference_service.engine.types import GenerationOutcome, GenerationParams, TokenEvent
from inference_service.model.batch_forward import has_sliding_layers


def generate_choices(parts: EngineParts, params: GenerationParams, on_token: OnToken | None = None,
                     should_stop: ShouldStop = lambda: False) -> list[GenerationOutcome]:
    """params.n completions of one prompt, in index order; events carry the choice's index.

    Raises:
        InvalidRequest, PromptTooLong: as pipeline.generate_one.
    """
    if params.n == 1:
        return [generate_one(parts, params, on_token, should_stop)[0]]
    if has_sliding_layers(parts.model.config):
        return _one_after_another(parts, params, on_token, should_stop)
    return run_to_completion(parts, lambda on_done: [StreamRequest(params, on_token, should_stop, on_done)])


def _one_after_another(parts: EngineParts, params: GenerationParams, on_token: OnToken | None,
                       should_stop: ShouldStop) -> list[GenerationOutcome]:
    outcomes = []
    for index in range(params.n):
        single = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index,
                                     prompt_logprobs=params.prompt_logprobs if index == 0 else None)

        def relabel(event: TokenEvent, index: int = index) -> None:
            on_token(dataclasses.replace(event, index=index))

        outcome = generate_one(parts, single, relabel if on_token is not None else None, should_stop)[0]
        outcome.index = index
        outcomes.append(outcome)
    return outcomes
