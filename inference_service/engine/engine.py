"""The Engine: builds the parts every request needs, and fronts requests, batches, warm-up and verification."""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from inference_service.engine import batch
from inference_service.engine.choices import generate_choices
from inference_service.engine.counters import EngineStats
from inference_service.engine.generation import OnToken, eos_token_ids
from inference_service.engine.logprobs import token_text
from inference_service.engine.pipeline import (
    EngineParts, generate_one, plan_request, plan_segments, repair_options, salted,
)
from inference_service.engine.prompts import PromptPlan, tokenize_document, tokenize_messages, tokenize_prompt
from inference_service.engine.scheduler import OnDone, StreamRequest
from inference_service.engine.types import EngineConfig, GenerationOutcome, GenerationParams, WarmOutcome
from inference_service.engine.verification import (
    BUILTIN_PROMPTS, first_token_cosine, first_token_kl, matching_prefix_tokens,
)
from inference_service.engine.writeback import PendingChunks, WriteBack
from inference_service.errors import InvalidRequest
from inference_service.kv import codec
from inference_service.kv.namespace import (
    NamespaceSpec, canonical_config_json, dtype_name, namespace_digest, tokenizer_identity,
)
from inference_service.kv.repair import MASKABLE_ATTENTION, RepairOptions
from inference_service.kv.rope import RopeParams, UnsupportedRope, rope_parameters
from inference_service.model.forward import prefill
from inference_service.model.kv_buffers import allocate_kv, build_cache, kv_geometry
from inference_service.store.protocol import ChunkStore

__all__ = ["Engine", "EngineConfig", "GenerationOutcome", "GenerationParams", "WarmOutcome"]

logger = logging.getLogger(__name__)


class Engine:
    """The product's front to the model: requests, batches, warm-up, verification, info and stats."""

    def __init__(self, model, tokenizer, config: EngineConfig, store: ChunkStore, model_id: str = "") -> None:
        self.model_id = model_id or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        geometry = kv_geometry(model.config)
        counters = EngineStats()
        # Rotary parameters for moving stored keys: re-rotating content hits, un-rotating keys before they
        # are quantized and rotating such keys back into place on every hit. None: RoPE that cannot be moved.
        key_rope = _rope_or_none(model.config)
        content_rope = key_rope
        attention = getattr(model.config, "_attn_implementation", None)
        if content_rope is not None and attention not in MASKABLE_ATTENTION:
            logger.info("content hits will not be reused: repair needs %s attention, the model uses %r",
                        " or ".join(MASKABLE_ATTENTION), attention)
            content_rope = None  # content hits then fall back to prefix reuse instead of failing requests
        self.parts = EngineParts(
            model=model, tokenizer=tokenizer, config=config, store=store,
            namespace=namespace_digest(NamespaceSpec(
                model_id=self.model_id,
                config_json=canonical_config_json(model.config),
                dtype=dtype_name(model.dtype),
                tokenizer_id=tokenizer_identity(tokenizer),
                chunk_size=config.chunk_size,
                kv_cache_bits=config.kv_cache_bits,
                format_version=codec.BLOB_FORMAT_VERSION,
                tenant_salt=config.tenant_salt,
            )),
            geometry=geometry,
            max_prompt_tokens=config.max_prompt_tokens or geometry.max_context,
            eos_ids=eos_token_ids(model, tokenizer),
            counters=counters,
            writeback=WriteBack(store, config.kv_cache_bits, counters.add_stored, config.kv_group_size,
                                key_rope if config.keys_before_rope else None),
            key_rope=key_rope,
            content_rope=content_rope,
        )

    # What callers read most; everything else is on self.parts.
    model = property(lambda self: self.parts.model)
    tokenizer = property(lambda self: self.parts.tokenizer)
    config = property(lambda self: self.parts.config)
    store = property(lambda self: self.parts.store)
    namespace = property(lambda self: self.parts.namespace)
    geometry = property(lambda self: self.parts.geometry)
    device = property(lambda self: self.parts.device)
    dtype = property(lambda self: self.parts.dtype)

    # ---- requests -------------------------------------------------------------------------------

    def generate(self, params: GenerationParams, on_token: OnToken | None = None,
                 should_stop: Callable[[], bool] = lambda: False) -> GenerationOutcome:
        """Runs one request to the end, streaming through on_token(text, token_ids).

        Raises:
            InvalidRequest: parameters the server does not accept.
            PromptTooLong: more prompt tokens than max_prompt_tokens.
        """
        return generate_one(self.parts, params, on_token, should_stop)[0]

    def generate_choices(self, params: GenerationParams, on_token: OnToken | None = None,
                         should_stop: Callable[[], bool] = lambda: False) -> list[GenerationOutcome]:
        """params.n completions of one prompt (one prefill, n rows decoded together), in index order.

        Raises:
            InvalidRequest, PromptTooLong: as generate().
        """
        return generate_choices(self.parts, params, on_token, should_stop)

    def tokenize(self, prompt: str | None = None, messages=None, add_special_tokens: bool = True,
                 add_generation_prompt: bool = True) -> tuple[list[int], list[str]]:
        """(token ids, each token decoded alone) of a prompt or chat, as Generate tokenizes it.

        Raises:
            InvalidRequest: neither or both of prompt and messages.
        """
        if bool(prompt) == bool(messages):
            raise InvalidRequest("Tokenize needs exactly one of prompt and messages")
        if messages:
            _check_roles(messages)
            token_ids = tokenize_messages(self.tokenizer, messages, add_generation_prompt)[0]
        else:
            token_ids = list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        return token_ids, [token_text(self.tokenizer, token_id) for token_id in token_ids]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Raises InvalidRequest for ids outside the vocabulary."""
        vocab_size = len(self.tokenizer)
        wrong = [token_id for token_id in token_ids if not 0 <= token_id < vocab_size]
        if wrong:
            raise InvalidRequest(f"token ids {wrong[:5]} are outside the vocabulary (0..{vocab_size - 1})")
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def generate_with_first_logits(self, params: GenerationParams) -> tuple[GenerationOutcome, torch.Tensor | None]:
        """generate() without streaming, plus the logits the first token was chosen from ([vocab] float32)."""
        return generate_one(self.parts, params)

    def generate_batch(self, params_list: Sequence[GenerationParams], should_stop: Callable[[], bool] = lambda: False,
                       pad_token_id: int | None = None) -> list[GenerationOutcome]:
        """Prompts run together, their common leading chunks prefilled once (see batch.generate_batch); input order kept."""
        return batch.generate_batch(self.parts, params_list, should_stop, pad_token_id)

    def generate_many(self, params_list: Sequence[GenerationParams], should_stop: Callable[[], bool] = lambda: False,
                      pad_token_id: int | None = None) -> list[GenerationOutcome]:
        """Prompts grouped by first chunk, each group's common leading chunks prefilled once; input order kept."""
        return batch.generate_many(self.parts, params_list, should_stop, pad_token_id)

    def batch_requests(self, params_list: Sequence[GenerationParams], by_first_chunk: bool,
                       should_stop: Callable[[], bool], on_done: OnDone) -> list[StreamRequest]:
        """A batch call's requests for the service's scheduler (see batch.batch_requests); raises as generate_batch."""
        return batch.batch_requests(self.parts, params_list, by_first_chunk, should_stop, on_done)

    def plan_request(self, params: GenerationParams) -> tuple[str, PromptPlan, int]:
        """(mode, planned prompt, capped max_new_tokens); see pipeline.plan_request."""
        return plan_request(self.parts, params)

    def repair_options(self, params: GenerationParams | None = None) -> RepairOptions:
        """The request's repair of content hits, the server's defaults where it names none."""
        return repair_options(self.parts, params)

    # ---- warm, verify, info ---------------------------------------------------------------------

    def warm(self, text: str | None, messages=None, content_addressed: bool = False, pin: bool = False,
             cache_salt: str = "") -> WarmOutcome:
        """Computes and stores every chunk of the text (or chat prefix, no generation prompt), the tokens
        after the last full chunk as a partial chunk, so a prompt that continues the text reuses all of it.

        content_addressed: the text is chunked as a segment and every chunk is also keyed by content.
        cache_salt: stored under that salt's namespace, where requests with the same cache_salt find them.

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
        parts = salted(self.parts, cache_salt)
        prompt = plan_segments(parts, segments)
        chunks = list(prompt.chunks.chunks)
        prefix_keys = list(prompt.prefix_keys)
        content_keys: list[bytes | None] = list(prompt.content_keys) if content_addressed else [None] * len(chunks)
        tail = prompt.tail_chunk()
        if tail is not None:
            chunks.append(tail)
            prefix_keys.append(prompt.tail_key)
            content_keys.append(None)
        buffers = allocate_kv(self.geometry, prompt.num_tokens, self.device, self.dtype)
        token_ids = torch.tensor(prompt.token_ids, device=self.device)
        _, new_kv = prefill(self.model, build_cache(self.model.config, *buffers, 0), token_ids, 0)
        stored = parts.writeback.store_now(PendingChunks(
            parts.namespace, tuple(chunks), tuple(prefix_keys), tuple(content_keys), new_kv, 0, pin=pin))
        num_tail = len(prompt.chunks.tail)
        note = "" if num_tail == 0 else (
            f"the last {num_tail} tokens are stored as a partial chunk: a prompt reuses them when it continues "
            f"this text token for token (where its tokenization differs at the join, only the "
            f"{prompt.num_tokens - num_tail} tokens of whole chunks are reused)")
        return WarmOutcome(stored, prompt.num_tokens, self.config.chunk_size, num_tail == 0, num_tail, note)

    def verify(self, prompts: list[str], max_new_tokens: int = 32, mode: str = "prefix_cache") -> list[dict]:
        """BASELINE against `mode` per prompt (the cached mode runs twice, so the second run has hits).

        Compares our own modes with each other (its job); identity with plain transformers `model.generate`
        is checked by the test suite, never by this.
        """
        reports = []
        for prompt in prompts or BUILTIN_PROMPTS:
            def run(run_mode: str):
                return self.generate_with_first_logits(
                    GenerationParams(prompt=prompt, max_new_tokens=max_new_tokens, mode=run_mode))
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
        return {**self.parts.counters.snapshot(), "degraded": bool(getattr(self.store, "degraded", False))}

    def flush_writes(self, timeout: float | None = None) -> None:
        """Waits for queued write-backs (tests, shutdown)."""
        self.parts.writeback.flush(timeout)

    def close(self) -> None:
        """Finishes queued write-backs and stops the write-back thread."""
        self.parts.writeback.close()


def _rope_or_none(config) -> RopeParams | None:
    """The model's rotary parameters, or None (content hits then fall back to prefix reuse only)."""
    try:
        return rope_parameters(config)
    except (UnsupportedRope, AttributeError, KeyError) as error:
        logger.info("content hits will not be reused by this model: %s", error)
        return None


def _check_roles(messages) -> None:
    # The same check a Generate request's messages get (GenerationParams validates them).
    GenerationParams(messages=tuple(messages))
