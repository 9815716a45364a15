"""The engine: prompt -> cached chunks -> one prefill of the live suffix -> streamed decode -> write-back."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from inference_service.kv import codec
from inference_service.engine.assembler import AssembledContext, assemble_context, empty_context
from inference_service.store.protocol import ChunkStore
from inference_service.engine.content_reuse import exact_pending_chunks, prefill_with_content_hits
from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.engine.types import EngineConfig, GenerationOutcome, GenerationParams, WarmOutcome
from inference_service.errors import InvalidRequest, PromptTooLong
from inference_service.engine.generation import DecodeResult, OnToken, SamplingSettings, decode_loop, eos_token_ids
from inference_service.kv.namespace import NamespaceSpec, namespace_digest
from inference_service.kv.repair import MASKABLE_ATTENTION, RepairOptions
from inference_service.kv.rope import RopeParams, UnsupportedRope, rope_parameters
from inference_service.engine.prompts import (
    PromptPlan, plan_prompt, tokenize_document, tokenize_messages, tokenize_prompt, tokenize_segments,
)
from inference_service.model.kv_buffers import allocate_kv, build_cache, kv_geometry
from inference_service.kv.namespace import canonical_config_json, dtype_name, tokenizer_identity
from inference_service.model.loading import prefer_gqa_attention
from inference_service.model.forward import prefill
from inference_service.engine.counters import EngineStats
from inference_service.engine.verification import (
    BUILTIN_PROMPTS, first_token_cosine, first_token_kl, matching_prefix_tokens,
)
from inference_service.engine.writeback import PendingChunks, WriteBack

__all__ = ["Engine", "EngineConfig", "GenerationOutcome", "GenerationParams", "WarmOutcome"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Prefilled:
    """A prompt after its one prefill: what decoding and write-back need."""

    prompt: PromptPlan
    context: AssembledContext
    num_cached_tokens: int  # leading tokens whose K/V came from the cache (< prompt length)
    cache: object  # the DynamicCache, ready for decoding
    first_logits: torch.Tensor  # [vocab]
    pending: PendingChunks | None  # new full chunks to store after the first token


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig, cache: ChunkStore, model_id: str = "") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.cache = cache
        self.model_id = model_id or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self.device = model.device
        self.dtype = model.dtype
        prefer_gqa_attention(self.device)
        self.geometry = kv_geometry(model.config)
        self.max_prompt_tokens = config.max_prompt_tokens or self.geometry.max_context
        self.namespace = namespace_digest(NamespaceSpec(
            model_id=self.model_id,
            config_json=canonical_config_json(model.config),
            dtype=dtype_name(self.dtype),
            tokenizer_id=tokenizer_identity(tokenizer),
            chunk_size=config.chunk_size,
            kv_cache_bits=config.kv_cache_bits,
            format_version=codec.BLOB_FORMAT_VERSION,
            tenant_salt=config.tenant_salt,
        ))
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.counters = EngineStats()
        # Rotary parameters for moving stored keys: re-rotating content hits, un-rotating keys before they
        # are quantized and rotating such keys back into place on every hit. None: RoPE that cannot be moved.
        self.key_rope = _rope_or_none(model.config)
        self._writeback = WriteBack(cache, config.kv_cache_bits, self.counters.add_stored, config.kv_group_size,
                                    self.key_rope if config.keys_before_rope else None)
        self.rope = self.key_rope  # content hits; None: they fall back to prefix reuse
        attention = getattr(model.config, "_attn_implementation", None)
        if self.rope is not None and attention not in MASKABLE_ATTENTION:
            logger.info("content hits will not be reused: repair needs %s attention, the model uses %r",
                        " or ".join(MASKABLE_ATTENTION), attention)
            self.rope = None  # content hits then fall back to prefix reuse instead of failing requests

    # ---- requests -------------------------------------------------------------------------------

    def generate(self, params: GenerationParams, on_token: OnToken | None = None,
                 should_stop: Callable[[], bool] = lambda: False) -> GenerationOutcome:
        """Runs one request to the end, streaming through on_token(text, token_ids).

        Raises:
            InvalidRequest: parameters the server does not accept.
            PromptTooLong: more prompt tokens than max_prompt_tokens.
        """
        return self._generate(params, on_token, should_stop)[0]

    def _generate(self, params: GenerationParams, on_token: OnToken | None,
                  should_stop: Callable[[], bool]) -> tuple[GenerationOutcome, torch.Tensor | None]:
        mode, prompt, max_new_tokens = self.plan_request(params)
        if should_stop():  # cancelled or past its deadline while queued
            return self._outcome(params, mode, prompt, None, _cancelled_before_start()), None
        prefilled = self._prefill(prompt, mode, prompt.num_tokens + max_new_tokens, params.request_id,
                                  self.repair_options(params))
        decoded = decode_loop(
            self.model, prefilled.cache, prefilled.first_logits, prompt.num_tokens,
            IncrementalDetokenizer(self.tokenizer, prompt.token_ids, params.stop),
            SamplingSettings(params.temperature, params.top_k, params.top_p, params.seed),
            self.eos_ids, max_new_tokens, on_token, should_stop,
            after_first_token=lambda: self.submit_write_back(prefilled.pending),
        )
        outcome = self._outcome(params, mode, prompt, prefilled, decoded)
        logger.info("[%s] %s: %d prompt tokens, %d cached, ttft %.1f ms, %d generated (%s)%s",
                    params.request_id, mode, outcome.prompt_tokens, outcome.cached_tokens, outcome.ttft_ms,
                    outcome.generated_tokens, outcome.finish_reason, " degraded" if outcome.degraded else "")
        return outcome, prefilled.first_logits

    def plan_request(self, params: GenerationParams) -> tuple[str, PromptPlan, int]:
        """(mode, tokenized and keyed prompt, max_new_tokens capped by the context room) of a request.

        Raises:
            InvalidRequest: max_new_tokens over the server's limit, or an empty prompt.
            PromptTooLong: more prompt tokens than max_prompt_tokens.
        """
        if params.max_new_tokens > self.config.max_new_tokens_limit:
            raise InvalidRequest(f"max_new_tokens {params.max_new_tokens} is over the server's limit "
                                 f"{self.config.max_new_tokens_limit}")
        prompt = self._plan(self._tokenize(params))
        room = max(1, self.geometry.max_context - prompt.num_tokens)
        return params.mode or self.config.default_mode, prompt, min(params.max_new_tokens, room)

    def _tokenize(self, params: GenerationParams) -> list[list[int]]:
        if params.prompt:
            return tokenize_prompt(self.tokenizer, params.prompt)
        if params.messages:
            return tokenize_messages(self.tokenizer, params.messages)
        return tokenize_segments(self.tokenizer, params.segments or ())

    def _plan(self, segments: list[list[int]]) -> PromptPlan:
        num_tokens = sum(len(segment) for segment in segments)
        if num_tokens == 0:
            raise InvalidRequest("the prompt has no tokens")
        if num_tokens > self.max_prompt_tokens:
            raise PromptTooLong(num_tokens, self.max_prompt_tokens)
        return plan_prompt(self.namespace, segments, self.config.chunk_size)

    def repair_options(self, params: GenerationParams | None = None) -> RepairOptions:
        """The request's repair of content hits, the server's defaults where it names none."""
        config = self.config

        def pick(name: str, default):
            given = getattr(params, name, None)
            return default if given is None else given

        return RepairOptions(
            strategy=pick("recompute_strategy", config.default_recompute_strategy),
            recompute_ratio=pick("recompute_ratio", config.recompute_ratio),
            selective_tokens=pick("selective_tokens", config.selective_tokens),
            sink_tokens=pick("sink_tokens", config.sink_tokens),
            check_layers=min(config.check_layers, max(1, self.geometry.num_layers - 1)),
        )

    def _prefill(self, prompt: PromptPlan, mode: str, capacity: int, request_id: str,
                 repair: RepairOptions | None = None) -> _Prefilled:
        """Reuses what the cache has, then runs the rest of the prompt; capacity: prompt plus new tokens.

        In chunk_kv_reuse mode, content hits after the prefix run are re-rotated, placed and repaired
        by `repair` (the server's defaults when None) in the same pass that computes the missing tokens.
        """
        if mode == "baseline":
            context = empty_context()
        else:
            context = assemble_context(self.cache, self.namespace, prompt, self.geometry, self.device, self.dtype,
                                       capacity, with_content_hits=mode == "chunk_kv_reuse", rope=self.key_rope)
        if mode == "chunk_kv_reuse" and context.content_hits and not context.degraded:
            reused = prefill_with_content_hits(self.model, self.cache, prompt, context, self.geometry, self.rope,
                                               repair or self.repair_options(),
                                               capacity, overlap_tokens=self.config.overlap_tokens)
            if reused is not None:
                pending = exact_pending_chunks(self.namespace, prompt, context, reused, request_id)
                context.num_recomputed_tokens = reused.num_recomputed_tokens
                context.num_bytes_fetched += reused.num_bytes_fetched
                context.num_cached_chunks += reused.num_content_chunks
                context.degraded = reused.degraded
                return _Prefilled(prompt, context, reused.num_cached_tokens, reused.cache, reused.first_logits,
                                  None if reused.degraded else pending)
        # At least the last prompt token is always run, so there are logits to start from.
        num_cached = min(context.num_cached_tokens, prompt.num_tokens - 1)
        buffers = (context.key_buffer, context.value_buffer)
        if buffers[0] is None:
            buffers = allocate_kv(self.geometry, capacity, self.device, self.dtype)
        cache = build_cache(self.model.config, *buffers, num_cached)
        live = torch.tensor(prompt.token_ids[num_cached:], device=self.device)
        first_logits, new_kv = prefill(self.model, cache, live, num_cached)
        pending = None
        if mode != "baseline" and not context.degraded:
            index = context.num_cached_chunks
            pending = PendingChunks(self.namespace, prompt.chunks.chunks[index:], prompt.prefix_keys[index:],
                                    prompt.content_keys[index:], new_kv, num_cached, request_id=request_id)
        return _Prefilled(prompt, context, num_cached, cache, first_logits, pending)

    def submit_write_back(self, pending: PendingChunks | None) -> None:
        """Queues new chunks for the background write-back; returns at once."""
        if pending is not None:
            self._writeback.submit(pending)

    def _outcome(self, params: GenerationParams, mode: str, prompt: PromptPlan, prefilled: _Prefilled | None,
                 decoded: DecodeResult) -> GenerationOutcome:
        context = prefilled.context if prefilled else empty_context()
        num_cached = prefilled.num_cached_tokens if prefilled else 0
        outcome = outcome_of(params, mode, prompt.num_tokens, num_cached, context.num_recomputed_tokens, decoded,
                             context.degraded)
        self.counters.add_request(prompt.num_tokens, num_cached, context.num_recomputed_tokens,
                                  context.num_cached_chunks, context.num_bytes_fetched,
                                  outcome.ttft_ms if outcome.generated_tokens else None)
        return outcome

    # ---- warm, verify, info ---------------------------------------------------------------------

    def warm(self, text: str | None, messages=None, content_addressed: bool = False, pin: bool = False) -> WarmOutcome:
        """Computes and stores every full chunk of the text (or chat prefix, no generation prompt).

        content_addressed: the text is chunked as a segment (its partial last chunk stored too) and
        every chunk is also keyed by content.

        Raises:
            InvalidRequest: neither text nor messages.
            PromptTooLong: more tokens than max_prompt_tokens.
            StoreUnavailable: the cache cannot be reached.
        """
        if messages:
            segments = tokenize_messages(self.tokenizer, messages, add_generation_prompt=False)
        elif text and content_addressed:
            segments = tokenize_document(self.tokenizer, text)
        elif text:
            segments = tokenize_prompt(self.tokenizer, text)
        else:
            raise InvalidRequest("Warm needs text or messages")
        prompt = self._plan(segments)
        chunks = prompt.chunks.chunks
        stored = 0
        if chunks:
            num_chunk_tokens = chunks[-1].end
            buffers = allocate_kv(self.geometry, num_chunk_tokens, self.device, self.dtype)
            token_ids = torch.tensor(prompt.token_ids[:num_chunk_tokens], device=self.device)
            _, new_kv = prefill(self.model, build_cache(self.model.config, *buffers, 0), token_ids, 0)
            content_keys = prompt.content_keys if content_addressed else (None,) * len(chunks)
            stored = self._writeback.store_now(PendingChunks(
                self.namespace, chunks, prompt.prefix_keys, content_keys, new_kv, 0, pin=pin))
        tail = len(prompt.chunks.tail)
        warning = "" if tail == 0 else (
            f"{tail} tokens after the last full chunk are not stored; a prompt that starts with this text "
            f"reuses at most {prompt.num_tokens - tail} of its tokens")
        return WarmOutcome(stored, prompt.num_tokens, self.config.chunk_size, tail == 0, tail, warning)

    def verify(self, prompts: list[str], max_new_tokens: int = 32, mode: str = "prefix_cache") -> list[dict]:
        """BASELINE against `mode` per prompt (the cached mode runs twice, so the second run has hits)."""
        reports = []
        for prompt in prompts or BUILTIN_PROMPTS:
            def run(run_mode: str):
                return self._generate(GenerationParams(prompt=prompt, max_new_tokens=max_new_tokens, mode=run_mode),
                                      None, lambda: False)
            baseline, baseline_logits = run("baseline")
            run(mode)
            self.flush_writes()
            cached, cached_logits = run(mode)
            reports.append({
                "prompt": prompt,
                "token_identical": baseline.output_token_ids == cached.output_token_ids,
                "first_token_cosine": first_token_cosine(baseline_logits, cached_logits),
                "first_token_kl": first_token_kl(baseline_logits, cached_logits),
                "matching_prefix_tokens": matching_prefix_tokens(baseline.output_token_ids, cached.output_token_ids),
                "cached_tokens": cached.cached_tokens,
                "baseline_text": baseline.output_text,
                "cached_text": cached.output_text,
            })
        return reports

    def model_info(self) -> dict:
        """Fields of ModelInfoReply."""
        names = getattr(self.model.config, "architectures", None) or [type(self.model).__name__]
        return {
            "model": self.model_id,
            "architecture": names[0],
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "num_layers": self.geometry.num_layers,
            "num_kv_heads": self.geometry.num_kv_heads,
            "head_dim": self.geometry.head_dim,
            "max_context": self.geometry.max_context,
            "chunk_size": self.config.chunk_size,
            "kv_cache_bits": self.config.kv_cache_bits,
            "namespace_hex": self.namespace.hex(),
            "default_recompute_strategy": self.config.default_recompute_strategy,
        }

    def stats(self) -> dict:
        """Fields of ServiceStatsReply the engine knows."""
        return {**self.counters.snapshot(), "degraded": bool(getattr(self.cache, "degraded", False))}

    def flush_writes(self, timeout: float | None = None) -> None:
        """Waits for queued write-backs (tests, shutdown)."""
        self._writeback.flush(timeout)

    def close(self) -> None:
        """Finishes queued write-backs and stops the write-back thread."""
        self._writeback.close()


def outcome_of(params: GenerationParams, mode: str, prompt_tokens: int, cached_tokens: int, recomputed_tokens: int,
               decoded: DecodeResult, degraded: bool) -> GenerationOutcome:
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
    )


def _rope_or_none(config) -> RopeParams | None:
    """The model's rotary parameters, or None (content hits then fall back to prefix reuse only)."""
    try:
        return rope_parameters(config)
    except (UnsupportedRope, AttributeError, KeyError) as error:
        logger.info("content hits will not be reused by this model: %s", error)
        return None


def _cancelled_before_start() -> DecodeResult:
    return DecodeResult([], "", "cancelled", 0.0, 0.0)
