"""A prompt's uncached tokens run a bounded piece at a time, so a long prefill does not stall running decodes."""
from __future__ import annotations

from typing import Sequence

import torch

from inference_service.engine.assembler import AssembledContext
from inference_service.engine.pipeline import (
    EngineParts, Prefilled, assemble_for, needs_repair, new_chunks, prefill_assembled,
)
from inference_service.engine.prompts import PromptPlan
from inference_service.kv.repair import RepairOptions
from inference_service.model.batch_forward import PrefillRow, prefill_rows
from inference_service.model.forward import prefill
from inference_service.model.kv_buffers import allocate_kv, build_cache


class ChunkedPrefill:
    """Prefix hits are assembled at once; the live suffix then runs `advance(max_tokens)` tokens per call.

    Content hits that need repair, and requests that want every prompt token's logprob, run their whole
    prefill in the first call (repair sees the whole prompt in one pass). `done` is the Prefilled at the end.
    context: K/V to start from instead of asking the store (a batch's shared prefix, copied in).
    need_logits: False for a shared prefix, which needs no first token: when the store holds all of it,
    nothing runs and `done` is set at once.
    """

    def __init__(self, parts: EngineParts, prompt: PromptPlan, mode: str, capacity: int, request_id: str,
                 repair: RepairOptions | None = None, num_prompt_logprobs: int | None = None,
                 context: AssembledContext | None = None, need_logits: bool = True) -> None:
        self.parts, self.prompt, self.mode, self.request_id = parts, prompt, mode, request_id
        self.capacity, self.repair, self.num_prompt_logprobs = capacity, repair, num_prompt_logprobs
        self.context = context or assemble_for(parts, prompt, mode, capacity, num_prompt_logprobs)
        self.whole = num_prompt_logprobs is not None or needs_repair(mode, self.context)
        self.done: Prefilled | None = None
        # The last prompt token runs when its logits choose the first new token.
        self.num_cached = min(self.context.num_cached_tokens, prompt.num_tokens - int(need_logits))
        self.position = self.num_cached  # the next prompt token to run
        self.buffers = (self.context.key_buffer, self.context.value_buffer)
        if self.buffers[0] is None:
            self.buffers = allocate_kv(parts.geometry, capacity, parts.device, parts.dtype)
        self.cache = build_cache(parts.model.config, *self.buffers, self.num_cached)
        if self.num_remaining == 0:
            self.done = self._finish(None)

    @property
    def num_remaining(self) -> int:
        return self.prompt.num_tokens - self.position

    def advance(self, max_tokens: int) -> int:
        """Runs up to max_tokens more prompt tokens (all of them for a whole prefill); returns how many ran."""
        assert self.done is None and max_tokens > 0, "advance needs tokens to run and a prefill not yet done"
        if self.whole:
            self.done = prefill_assembled(self.parts, self.prompt, self.mode, self.context, self.capacity,
                                          self.request_id, self.repair, num_prompt_logprobs=self.num_prompt_logprobs)
            return self.prompt.num_tokens - self.done.num_cached_tokens
        begin, end = self.position, min(self.position + max_tokens, self.prompt.num_tokens)
        live = torch.tensor(self.prompt.token_ids[begin:end], device=self.parts.device)
        logits, _ = prefill(self.parts.model, self.cache, live, begin)
        self.position = end
        if end == self.prompt.num_tokens:
            self.done = self._finish(logits)
        return end - begin

    def _finish(self, first_logits: torch.Tensor | None) -> Prefilled:
        parts, prompt, context = self.parts, self.prompt, self.context
        keys, values = self.buffers  # [layers, kv_heads, capacity, head_dim]
        # Every token this request computed, per layer, as the write-back reads them.
        new_kv = [(keys[layer : layer + 1, :, self.num_cached : prompt.num_tokens],
                   values[layer : layer + 1, :, self.num_cached : prompt.num_tokens])
                  for layer in range(parts.geometry.num_layers)]
        pending = None
        if self.mode != "baseline" and not context.degraded and self.num_cached < prompt.num_tokens:
            pending = new_chunks(parts, prompt, context, new_kv, self.num_cached, self.buffers, self.request_id)
        return Prefilled(prompt, context, self.num_cached, *self.buffers, self.cache, first_logits, pending)


def finish_together(prefills: Sequence[ChunkedPrefill], pad_token_id: int = 0) -> int:
    """Runs the rest of every prefill (none of them whole) in one batched forward; returns the tokens run.

    Several short suffixes in one forward cost much less than one forward each (the weights are read once,
    the matrix products are larger); a lone prefill takes the plain path.
    """
    if len(prefills) == 1:
        return prefills[0].advance(prefills[0].num_remaining)
    assert all(not p.whole and p.done is None for p in prefills), "whole prefills run alone"
    rows = [PrefillRow(*p.buffers, p.position, p.prompt.token_ids[p.position :]) for p in prefills]
    logits = prefill_rows(prefills[0].parts.model, rows, pad_token_id)
    num_run = 0
    for p, row_logits in zip(prefills, logits):
        num_run += p.num_remaining
        p.position = p.prompt.num_tokens
        p.cache = build_cache(p.parts.model.config, *p.buffers, p.position)
        p.done = p._finish(row_logits)
    return num_run
