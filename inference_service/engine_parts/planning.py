"""What every request needs (EngineParts), and the pure steps around the model: plan a request, name its new
chunks, account its outcome."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from inference_service.reuse.assembler import AssembledContext
from inference_service.engine_parts.counters import EngineStats
from inference_service.engine_parts.generation import DecodeResult
from kvboost_keys.prompts import PromptPlan, plan_prompt, tokenize_request, tokenize_warm
from inference_service.engine_parts.types import EngineConfig, GenerationOutcome, GenerationParams
from inference_service.kv_memory.host_tier import HostTier
from inference_service.kv_memory.l0_tier import L0Tier
from inference_service.kv_memory.memory_plan import Tiers
from inference_service.reuse.writeback import PendingChunks, WriteBack
from inference_service.errors import InvalidRequest, PromptTooLong
from kvboost_keys.namespace import Namespace, salted_namespace
from kvboost_keys.token_cache import TokenCache
from inference_service.kv.repair import RepairOptions
from inference_service.kv.rope import RopeParams
from inference_service.kv_memory.kv_buffers import KVGeometry
from inference_service.store.protocol import ChunkStore, DeleteEpoch

logger = logging.getLogger(__name__)

ShouldStop = Callable[[], bool]


@dataclass(slots=True, frozen=True)
class EngineParts:
    """What every request needs from the engine; built once by Engine."""

    model: object  # a transformers causal LM in eval mode
    tokenizer: object
    config: EngineConfig
    store: ChunkStore
    namespace: Namespace
    geometry: KVGeometry
    max_prompt_tokens: int
    eos_ids: frozenset[int]
    counters: EngineStats
    writeback: WriteBack
    tiers: Tiers  # L0 and the host tier: the same two the write-back fills
    # Moves stored keys: rotates un-rotated or content-hit keys into place. None: RoPE that cannot be moved.
    key_rope: RopeParams | None
    # Content hits are reused (re-rotated and repaired) only with this; None: they fall back to prefix reuse.
    content_rope: RopeParams | None
    # Token ids of long pieces of text seen before, keyed by the request's namespace; None: every text is tokenized.
    token_cache: TokenCache | None = None

    @property
    def l0(self) -> L0Tier | None:
        """L0 (kv_memory/l0_tier.py); None: off."""
        return self.tiers.l0

    @property
    def host(self) -> HostTier | None:
        """The host tier (kv_memory/host_tier.py); None: off."""
        return self.tiers.host

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def for_request(parts: EngineParts, params: GenerationParams) -> EngineParts:
    """The parts with the request's namespace: the engine's, salted by params.cache_salt when one is given."""
    return salted(parts, params.cache_salt)


def salted(parts: EngineParts, cache_salt: str) -> EngineParts:
    """The parts under salted_namespace(namespace, cache_salt); the same parts for an empty salt."""
    if not cache_salt:
        return parts
    return dataclasses.replace(parts, namespace=salted_namespace(parts.namespace, cache_salt))


# ---- planning -------------------------------------------------------------------------------------

def plan_request(parts: EngineParts, params: GenerationParams) -> tuple[str, PromptPlan, int]:
    """(mode, tokenized and keyed prompt, max_new_tokens capped by the context room) of a request.

    Raises:
        InvalidRequest: max_new_tokens over the server's limit, an empty prompt, or (strict_context) a prompt
            plus max_new_tokens beyond the context.
        PromptTooLong: more prompt tokens than max_prompt_tokens.
    """
    if params.max_new_tokens > parts.config.max_new_tokens_limit:
        raise InvalidRequest(f"max_new_tokens {params.max_new_tokens} is over the server's limit "
                             f"{parts.config.max_new_tokens_limit}")
    vocab_size = parts.model.config.get_text_config(decoder=True).vocab_size
    outside = [token_id for token_id in params.stop_token_ids if token_id >= vocab_size]
    if outside:
        raise InvalidRequest(f"stop_token_ids {outside[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    prompt = plan_segments(parts, tokenize_request(parts.tokenizer, params.prompt, params.messages, params.segments,
                                                   token_cache(parts), parts.namespace))
    if not params.segments:  # one segment: its chunks lie on one grid from position 0
        note_chunks(parts, prompt)
    max_context = parts.geometry.max_context
    if params.strict_context and prompt.num_tokens + params.max_new_tokens > max_context:
        raise InvalidRequest(f"the context holds {max_context} tokens, but {prompt.num_tokens + params.max_new_tokens} "
                             f"were asked for ({prompt.num_tokens} in the prompt, max_new_tokens "
                             f"{params.max_new_tokens}): shorten the prompt or lower max_new_tokens")
    room = max(1, max_context - prompt.num_tokens)
    return params.mode or parts.config.default_mode, prompt, min(params.max_new_tokens, room)


def token_cache(parts: EngineParts) -> TokenCache | None:
    """The tokenization cache, when it was built for the tokenizer the parts hold (never another's ids)."""
    cache = parts.token_cache
    return cache if cache is not None and cache.tokenizer is parts.tokenizer else None


def plan_segments(parts: EngineParts, segments: list[list[int]]) -> PromptPlan:
    """Chunks and keys of tokenized segments. Raises InvalidRequest (no tokens) or PromptTooLong."""
    num_tokens = sum(len(segment) for segment in segments)
    if num_tokens == 0:
        raise InvalidRequest("the prompt has no tokens")
    if num_tokens > parts.max_prompt_tokens:
        raise PromptTooLong(num_tokens, parts.max_prompt_tokens)
    return plan_prompt(parts.namespace, segments, parts.config.chunk_size)


def plan_warm(parts: EngineParts, text: str | None, messages, content_addressed: bool) -> PromptPlan:
    """Chunks and keys of a warm-up (and of the Unpin that undoes its pins): a chat prefix without the
    generation prompt, a document chunked as a segment (content-addressed: every chunk also keyed by its
    content), or raw text keyed by prefix only; no chunks for a text of no tokens (only characters the tokenizer
    drops, "\x04" say: nothing to store). Raises InvalidRequest (neither text nor messages) or PromptTooLong."""
    if not text and not messages:
        raise InvalidRequest("Warm needs text or messages")
    segments = tokenize_warm(parts.tokenizer, text, messages, content_addressed, token_cache(parts), parts.namespace)
    if not any(segments):
        return plan_prompt(parts.namespace, [], parts.config.chunk_size)
    prompt = plan_segments(parts, segments)
    if content_addressed:
        return prompt
    note_chunks(parts, prompt)
    return dataclasses.replace(prompt, content_keys=(None,) * len(prompt.prefix_keys))


def note_chunks(parts: EngineParts, prompt: PromptPlan) -> None:
    """Tells L0's listener (the KV-event publisher, when there is one) the tokens of a one-segment prompt's chunks,
    its tail included: L0 names the chunks it takes by key only. The listener only queues."""
    listener = parts.l0.listener if parts.l0 is not None else None
    if listener is None:
        return
    chunks = list(prompt.chunks.chunks)
    keys = list(prompt.prefix_keys)
    tail = prompt.tail_chunk()
    if tail is not None and prompt.tail_key is not None:
        chunks.append(tail)
        keys.append(prompt.tail_key)
    listener.note_prompt(prompt.namespace, keys, [chunk.start for chunk in chunks],
                         [chunk.token_ids for chunk in chunks])


def repair_options(parts: EngineParts, params: GenerationParams | None = None) -> RepairOptions:
    """The request's repair of content hits, the server's defaults where it names none."""
    config = parts.config

    def pick(name: str, default):
        given = getattr(params, name, None)
        return default if given is None else given

    return RepairOptions(
        strategy=pick("recompute_strategy", config.default_recompute_strategy),
        recompute_ratio=pick("recompute_ratio", config.recompute_ratio),
        selective_tokens=pick("selective_tokens", config.selective_tokens),
        sink_tokens=pick("sink_tokens", config.sink_tokens),
        check_layers=min(config.check_layers, max(1, parts.geometry.num_layers - 1)),
        guard_threshold=config.guard_threshold,
    )


def needs_repair(mode: str, context: AssembledContext) -> bool:
    """Content hits to re-rotate and repair (in one pass with the missing tokens)."""
    return mode == "chunk_kv_reuse" and bool(context.content_hits) and not context.degraded


def new_chunks(parts: EngineParts, prompt: PromptPlan, context: AssembledContext, new_kv, num_cached: int,
                buffers: tuple[torch.Tensor, torch.Tensor], request_id: str) -> PendingChunks:
    """Every chunk the store did not give, and the tail as a partial chunk (unless it came from the store):
    a later prompt that continues this one reuses it to its last token."""
    index = context.num_cached_chunks
    chunks, prefix_keys = list(prompt.chunks.chunks[index:]), list(prompt.prefix_keys[index:])
    content_keys: list[bytes | None] = list(prompt.content_keys[index:])
    parent_keys = [prompt.parent_key(i) for i in range(index, len(prompt.chunks.chunks))]
    tail = prompt.tail_chunk()
    if tail is not None and context.partial_key != prompt.tail_key:
        chunks.append(tail)
        prefix_keys.append(prompt.tail_key)
        content_keys.append(None)
        parent_keys.append(prompt.parent_key(len(prompt.chunks.chunks)))
    return PendingChunks(parts.namespace, tuple(chunks), tuple(prefix_keys), tuple(content_keys), new_kv, num_cached,
                         request_id=request_id, head_kv=buffers, parent_keys=tuple(parent_keys),
                         delete_epoch=context.delete_epoch)


def answer_chunks(prompt: PromptPlan, answer_ids: Sequence[int], chunk_size: int,
                  buffers: tuple[torch.Tensor, torch.Tensor], request_id: str,
                  delete_epoch: DeleteEpoch | None = None) -> PendingChunks | None:
    """The chunks of the prompt's tail and its answer, keyed as a prompt that continues this one would key them:
    the next turn of a conversation then finds the whole previous turn. answer_ids: the generated tokens whose
    K/V are in `buffers` (every one but the last, which was never fed back). Single-segment prompts only."""
    extended = plan_prompt(prompt.namespace, [list(prompt.token_ids) + list(answer_ids)], chunk_size)
    first = len(prompt.chunks.chunks)  # the prompt's whole chunks went with the prompt's own write-back
    chunks, prefix_keys = list(extended.chunks.chunks[first:]), list(extended.prefix_keys[first:])
    parent_keys = [extended.parent_key(i) for i in range(first, len(extended.chunks.chunks))]
    tail = extended.tail_chunk()
    if tail is not None:
        chunks.append(tail)
        prefix_keys.append(extended.tail_key)
        parent_keys.append(extended.parent_key(len(extended.chunks.chunks)))
    if not chunks:
        return None
    keys, values = buffers  # [layers, kv_heads, capacity, head_dim]
    start, end = chunks[0].start, extended.num_tokens
    new_kv = [(keys[layer : layer + 1, :, start:end], values[layer : layer + 1, :, start:end])
              for layer in range(keys.shape[0])]
    return PendingChunks(prompt.namespace, tuple(chunks), tuple(prefix_keys), (None,) * len(chunks), new_kv, start,
                         request_id=request_id, parent_keys=tuple(parent_keys), delete_epoch=delete_epoch)


def submit_write_back(parts: EngineParts, pending: PendingChunks | None) -> None:
    """Queues new chunks for the background write-back; returns at once."""
    if pending is not None:
        parts.writeback.submit(pending)


def record_outcome(parts: EngineParts, params: GenerationParams, mode: str, prompt: PromptPlan,
                   context: AssembledContext, num_cached: int, decoded: DecodeResult, count_fetched: bool = True,
                   label: str = "", index: int = 0) -> GenerationOutcome:
    """The finished request's result, added to the counters and logged.

    count_fetched: False for batch rows (and choices) after the first, whose shared chunks were fetched once.
    index: which of the request's n completions.
    """
    outcome = outcome_of(params, mode, prompt.num_tokens, num_cached, context.num_recomputed_tokens, decoded,
                         context.degraded, index)
    label_repair(outcome, context)
    if context.repair_checked:
        parts.counters.add_guard(context.fidelity_guard)
    parts.counters.add_request(prompt.num_tokens, num_cached, context.num_recomputed_tokens,
                               context.num_fetched_blobs if count_fetched else 0,
                               context.num_bytes_fetched if count_fetched else 0,
                               outcome.ttft_ms if outcome.generated_tokens else None,
                               min(context.num_partial_tokens, num_cached),
                               context.num_approximate_tokens if context.approximate else None)
    logger.info("[%s] %s%s: %d prompt tokens, %d cached, ttft %.1f ms, %d generated (%s)%s%s",
                params.request_id, mode, label, outcome.prompt_tokens, outcome.cached_tokens, outcome.ttft_ms,
                outcome.generated_tokens, outcome.finish_reason, " degraded" if outcome.degraded else "",
                f" APPROXIMATE ({outcome.approximate_tokens} tokens from content hits)" if outcome.approximate else "")
    return outcome


def label_repair(outcome: GenerationOutcome, context: AssembledContext) -> None:
    """What reuse of content hits did to the answer: approximate (and how many tokens), the repair's risk, the guard."""
    outcome.repair_risk, outcome.fidelity_guard = context.repair_risk, context.fidelity_guard
    outcome.approximate, outcome.approximate_tokens = context.approximate, context.num_approximate_tokens


def outcome_of(params: GenerationParams, mode: str, prompt_tokens: int, cached_tokens: int, recomputed_tokens: int,
               decoded: DecodeResult, degraded: bool, index: int = 0) -> GenerationOutcome:
    """A finished request's result; times are measured from the request's arrival."""
    generated = len(decoded.token_ids)
    decode_seconds = decoded.last_token_time - decoded.first_token_time
    return GenerationOutcome(
        output_text=decoded.text,
        generated_tokens=generated,
        output_token_ids=decoded.token_ids,
        ttft_ms=(decoded.first_token_time - params.arrival) * 1000 if generated else 0.0,
        total_ms=(decoded.last_token_time - params.arrival) * 1000 if generated else 0.0,
        tokens_per_sec=(generated - 1) / decode_seconds if generated > 1 and decode_seconds > 0 else 0.0,
        kv_reuse_ratio=cached_tokens / prompt_tokens,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        recomputed_tokens=recomputed_tokens,
        mode=mode,
        finish_reason=decoded.finish_reason,
        degraded=degraded,
        request_id=params.request_id,
        index=index,
    )


def cancelled_before_start() -> DecodeResult:
    return DecodeResult([], "", "cancelled", 0.0, 0.0)
