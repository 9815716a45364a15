"""Batched generation: prompts that share a prefix fetch it once, then one padded prefill and one decode loop.

Rows that cannot join the padded batch run alone through pipeline.generate_one, in the same call:
rows of another mode than the batch's (the most common one), CHUNK_KV_REUSE rows with content hits
(they need repair, which is per prompt), a batch of one row, and every row of a model with
sliding-window layers (pads would shift the window).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from inference_service.engine.assembler import AssembledContext, empty_context
from inference_service.engine.generation import DecodeResult, SamplingSettings, finish_reason
from inference_service.engine.pipeline import (
    EngineParts, ShouldStop, generate_one, plan_request, prefill_prompt, record_outcome, submit_write_back,
)
from inference_service.engine.prompts import PromptPlan
from inference_service.engine.types import GenerationOutcome, GenerationParams
from inference_service.engine.writeback import PendingChunks
from inference_service.errors import InvalidRequest, PromptTooLong
from inference_service.kv.chunking import ChunkPlan
from inference_service.model import batch_forward
from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.model.sampling import make_generator, sample
from inference_service.store.protocol import StoreUnavailable

logger = logging.getLogger(__name__)

# Rows per padded batch. No ServiceConfig flag sets it yet (a `--max-batch-size` would).
MAX_BATCH_SIZE = 16

@dataclass(slots=True)
class _Row:
    """One request of the batch: its plan, then its decoding state."""

    index: int  # position in the caller's list
    params: GenerationParams
    mode: str
    prompt: PromptPlan
    max_new_tokens: int  # the request's, capped by the room left in the context
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None

    def add(self, token_id: int, now: float, eos_ids: frozenset[int], should_stop: ShouldStop) -> None:
        self.token_ids.append(token_id)
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        self.detokenizer.add(token_id)
        settings = SamplingSettings.of(self.params)
        self.finish_reason = finish_reason(token_id, self.detokenizer, settings.eos_ids(eos_ids), len(self.token_ids),
                                           self.max_new_tokens, should_stop, settings.stop_token_ids)
        if self.finish_reason:
            self.detokenizer.finish()


@dataclass(slots=True)
class _SharedPrefix:
    num_tokens: int
    keys: torch.Tensor | None  # [layers, kv_heads, num_tokens, head_dim]
    values: torch.Tensor | None
    context: AssembledContext  # what the cache gave (num_cached_tokens <= num_tokens)
    pending: PendingChunks | None  # shared chunks computed here, to store after the first token


def generate_batch(parts: EngineParts, params_list: Sequence[GenerationParams], should_stop: ShouldStop = lambda: False,
                   pad_token_id: int | None = None) -> list[GenerationOutcome]:
    """Runs prompts that share a prefix as padded batches of at most MAX_BATCH_SIZE rows; input order kept.

    Raises:
        InvalidRequest: no requests, or one the server does not accept (nothing runs then).
        PromptTooLong: a prompt with more tokens than max_prompt_tokens.
    """
    rows = _plan_rows(parts, params_list)
    outcomes: list[GenerationOutcome | None] = [None] * len(rows)
    for start in range(0, len(rows), MAX_BATCH_SIZE):
        _run_rows(parts, rows[start : start + MAX_BATCH_SIZE], should_stop, pad_token_id, outcomes)
    return outcomes  # type: ignore[return-value]


def generate_many(parts: EngineParts, params_list: Sequence[GenerationParams], should_stop: ShouldStop = lambda: False,
                  pad_token_id: int | None = None) -> list[GenerationOutcome]:
    """Groups prompts by mode and first chunk (prefix key), runs each group as generate_batch does; input order kept.

    Prompts with no chunk before their last token share nothing and are batched together.

    Raises:
        InvalidRequest, PromptTooLong: as generate_batch.
    """
    rows = _plan_rows(parts, params_list)
    groups: dict[tuple[str, bytes | None], list[_Row]] = {}
    for row in rows:
        groups.setdefault((row.mode, _first_shareable_key(row.prompt)), []).append(row)
    outcomes: list[GenerationOutcome | None] = [None] * len(rows)
    for group in groups.values():
        for start in range(0, len(group), MAX_BATCH_SIZE):
            _run_rows(parts, group[start : start + MAX_BATCH_SIZE], should_stop, pad_token_id, outcomes)
    return outcomes  # type: ignore[return-value]


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


def _first_shareable_key(prompt: PromptPlan) -> bytes | None:
    chunks = prompt.chunks.chunks
    return prompt.prefix_keys[0] if chunks and chunks[0].end < prompt.num_tokens else None


# ---- planning ---------------------------------------------------------------------------------------

def _plan_rows(parts: EngineParts, params_list: Sequence[GenerationParams]) -> list[_Row]:
    if not params_list:
        raise InvalidRequest("a batch needs at least one request")
    rows = []
    for index, params in enumerate(params_list):
        try:
            _require_batchable(params)
            mode, prompt, max_new_tokens = plan_request(parts, params)
        except InvalidRequest as error:
            raise InvalidRequest(f"requests[{index}]: {error}") from None
        except PromptTooLong as error:
            named = PromptTooLong(error.num_tokens, error.max_tokens)
            named.args = (f"requests[{index}]: {error}",)
            raise named from None
        rows.append(_Row(index, params, mode, prompt, max_new_tokens))
    return rows


def _require_batchable(params: GenerationParams) -> None:
    """Batch rows take the fields every row's decode step handles; the rest need Generate."""
    unsupported = [name for name, used in (("n", params.n > 1), ("logprobs", params.logprobs is not None),
                                           ("prompt_logprobs", params.prompt_logprobs is not None),
                                           ("min_tokens", params.min_tokens > 0),
                                           ("cache_salt", bool(params.cache_salt))) if used]
    if unsupported:
        raise InvalidRequest(f"batches do not take {', '.join(unsupported)}; send such a request with Generate")


def _run_rows(parts: EngineParts, rows: list[_Row], should_stop: ShouldStop, pad_token_id: int | None,
              outcomes: list[GenerationOutcome | None]) -> None:
    batched, alone = _split_compatible(parts, rows)
    if batched:
        for row, outcome in zip(batched, _run_padded(parts, batched, should_stop, pad_token_id)):
            outcomes[row.index] = outcome
    for row in alone:
        outcomes[row.index] = generate_one(parts, row.params, should_stop=should_stop)[0]


def _split_compatible(parts: EngineParts, rows: list[_Row]) -> tuple[list[_Row], list[_Row]]:
    """(rows for the padded batch, rows to run alone); see the module docstring for who runs alone."""
    if len(rows) < 2 or batch_forward.has_sliding_layers(parts.model.config):
        return [], rows
    mode = Counter(row.mode for row in rows).most_common(1)[0][0]  # ties: the earliest row's mode
    batched = [row for row in rows if row.mode == mode and not _has_content_hits(parts, row)]
    if len(batched) < 2:
        return [], rows
    chosen = {id(row) for row in batched}
    return batched, [row for row in rows if id(row) not in chosen]


def _has_content_hits(parts: EngineParts, row: _Row) -> bool:
    if row.mode != "chunk_kv_reuse":
        return False
    try:
        lookup = parts.store.lookup(parts.namespace, list(row.prompt.prefix_keys), list(row.prompt.content_keys))
    except StoreUnavailable:
        return False  # served without the cache in the batch, as a single request would be
    return bool(lookup.content_hits)


# ---- the padded batch -------------------------------------------------------------------------------

def _run_padded(parts: EngineParts, rows: list[_Row], should_stop: ShouldStop, pad_token_id: int | None) -> list[GenerationOutcome]:
    mode = rows[0].mode
    if should_stop():  # cancelled or past its deadline while queued
        for row in rows:
            row.finish_reason = "cancelled"
        return [_outcome(parts, row, empty_context(), 0, 0) for row in rows]
    num_shared = 0 if mode == "baseline" else shared_chunk_count([row.prompt for row in rows])
    shared = _shared_prefix(parts, rows[0].prompt, num_shared, mode != "baseline", rows[0].params.request_id)
    for row in rows:
        row.detokenizer = IncrementalDetokenizer(parts.tokenizer, row.prompt.token_ids, row.params.stop)
        if row.params.temperature > 0:
            row.generator = make_generator(row.params.seed, parts.device)
    # Left padding puts every row's generated tokens after the longest prompt: row i's last one sits at
    # buffer index max prompt + its max_new_tokens - 1, whatever its own prompt length. Sized for that,
    # the buffers never grow (a grown layer would leave batch.keys stale for keep_rows).
    capacity = max(row.prompt.num_tokens for row in rows) + max(row.max_new_tokens for row in rows)
    batch = batch_forward.allocate_batch(parts.model.config, parts.geometry, len(rows), capacity, shared.keys,
                                        shared.values, parts.device, parts.dtype)
    suffixes = [row.prompt.token_ids[shared.num_tokens :] for row in rows]
    logits, row_kv = batch_forward.prefill_suffixes(parts.model, batch, suffixes, _pad_id(parts, pad_token_id))
    pending = [shared.pending] + [_row_pending(parts, row, num_shared, kv, shared.num_tokens)
                                  for row, kv in zip(rows, row_kv)]
    degraded = shared.context.degraded or (mode != "baseline" and num_shared == 0
                                           and bool(getattr(parts.store, "degraded", False)))
    _decode(parts, batch, rows, logits, should_stop,
            after_first_token=lambda: None if degraded or mode == "baseline" else _write_back(parts, pending))
    cached = min(shared.context.num_cached_tokens, shared.num_tokens)
    shared.context.degraded = degraded
    # Fetched chunks and bytes moved once: the counters charge them to the first row.
    return [_outcome(parts, row, shared.context, cached, position) for position, row in enumerate(rows)]


def _shared_prefix(parts: EngineParts, prompt: PromptPlan, num_chunks: int, use_store: bool,
                   request_id: str) -> _SharedPrefix:
    """The first num_chunks chunks' K/V: fetched once from the store, the rest computed once (batch of one)."""
    if num_chunks == 0:
        return _SharedPrefix(0, None, None, empty_context(), None)
    chunks = prompt.chunks.chunks[:num_chunks]
    num_tokens = chunks[-1].end
    plan = PromptPlan(prompt.token_ids[:num_tokens], ChunkPlan(chunks, (), num_tokens),
                      prompt.prefix_keys[:num_chunks], prompt.content_keys[:num_chunks], namespace=prompt.namespace)
    prefilled = prefill_prompt(parts, plan, "prefix_cache" if use_store else "baseline", num_tokens, request_id,
                               need_logits=False)
    keys, values = prefilled.key_buffer, prefilled.value_buffer  # [layers, kv_heads, num_tokens, head_dim]
    return _SharedPrefix(num_tokens, keys[:, :, :num_tokens], values[:, :, :num_tokens], prefilled.context,
                         prefilled.pending)


def _row_pending(parts: EngineParts, row: _Row, num_shared: int, kv, kv_start: int) -> PendingChunks:
    prompt = row.prompt
    return PendingChunks(parts.namespace, prompt.chunks.chunks[num_shared:], prompt.prefix_keys[num_shared:],
                         prompt.content_keys[num_shared:], kv, kv_start, request_id=row.params.request_id)


def _write_back(parts: EngineParts, pending: list[PendingChunks | None]) -> None:
    """Submits every chunk once (rows may repeat each other's chunks)."""
    seen: set[bytes] = set()
    for item in pending:
        if item is None:
            continue
        keep = [i for i, key in enumerate(item.prefix_keys) if key not in seen]
        seen.update(item.prefix_keys)
        if keep:
            submit_write_back(parts, PendingChunks(
                item.namespace, tuple(item.chunks[i] for i in keep), tuple(item.prefix_keys[i] for i in keep),
                tuple(item.content_keys[i] for i in keep), item.new_kv, item.kv_start, request_id=item.request_id))


def _decode(parts: EngineParts, batch: batch_forward.PaddedBatch, rows: list[_Row], logits: torch.Tensor,
            should_stop: ShouldStop, after_first_token: Callable[[], None]) -> None:
    """Samples every active row from its logits (logits: [active rows, vocab]) until each one finishes."""
    active = list(rows)  # in buffer order
    first_step = True
    while True:
        now = time.perf_counter()
        for slot, row in enumerate(active):
            params = row.params
            token = sample(logits[slot], params.temperature, params.top_k, params.top_p, row.generator)
            row.add(int(token), now, parts.eos_ids, should_stop)
        if first_step:
            after_first_token()
            first_step = False
        kept = [slot for slot, row in enumerate(active) if not row.finish_reason]
        if not kept:
            return
        if len(kept) < len(active):  # finished rows leave the batch and cost nothing more
            batch_forward.keep_rows(parts.model.config, batch, kept)
            active = [active[slot] for slot in kept]
        logits = batch_forward.decode_rows(
            parts.model, batch, [row.token_ids[-1] for row in active],
            [row.prompt.num_tokens + len(row.token_ids) - 1 for row in active])


def _pad_id(parts: EngineParts, pad_token_id: int | None) -> int:
    """Any id works (pads are masked); the tokenizer's pad, else EOS, else 0."""
    if pad_token_id is not None:
        return pad_token_id
    for candidate in (parts.tokenizer.pad_token_id, parts.tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def _outcome(parts: EngineParts, row: _Row, context: AssembledContext, num_cached: int,
             position: int) -> GenerationOutcome:
    decoded = DecodeResult(list(row.token_ids), row.detokenizer.text if row.detokenizer else "", row.finish_reason,
                           row.first_token_time, row.last_token_time)
    # The shared prefix was fetched once: its chunks and bytes count once, on the first row.
    return record_outcome(parts, row.params, row.mode, row.prompt, context, num_cached, decoded,
                          count_fetched=position == 0, label=f" batch row {position}")
