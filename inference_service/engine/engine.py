"""The Engine: builds the parts every request needs, and fronts requests, batches, warm-up and verification."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence as Seq

import torch

from inference_service.engine.batch import batch_sequences
from inference_service.engine.calibration import start_calibrated
from inference_service.engine.core import EngineCore
from inference_service.engine_parts.counters import EngineStats
from inference_service.engine_parts.generation import OnToken, eos_token_ids
from inference_service.engine_parts.logprobs import token_text
from inference_service.engine_parts.planning import EngineParts, plan_request, plan_warm, repair_options, salted, token_cache
from inference_service.engine.scheduler import SchedulerLimits, device_limits
from kvboost_keys.prompts import PromptPlan, tokenize_messages, tokenize_prompt
from inference_service.engine.request import OnDone, EngineRequest, WarmSpec
from inference_service.config import EngineConfig, resolve_guard_threshold
from inference_service.engine_parts.types import GenerationOutcome, GenerationParams, WarmOutcome
from inference_service.engine_parts.verification import BUILTIN_PROMPTS, compare_modes
from inference_service.kv_memory.memory_plan import build_tiers, size_tiers
from inference_service.reuse.writeback import WriteBack
from inference_service.errors import InvalidRequest
from kvboost_keys.namespace import dtype_name
from inference_service.engine.namespace import engine_namespace
from inference_service.kv.repair import MASKABLE_ATTENTION, RepairOptions
from inference_service.kv.rope import RopeParams, UnsupportedRope, rope_parameters
from inference_service.model.attention import use_engine_attention
from inference_service.engine.prefill import invariant_prefill_refusal
from inference_service.kv_memory.kv_buffers import kv_geometry
from inference_service.model.weights import state_fingerprint
from inference_service.store.protocol import ChunkStore
from kvboost_keys.token_cache import token_cache_for, token_cache_stats

ShouldStop = Callable[[], bool]

__all__ = ["Engine", "EngineConfig", "GenerationOutcome", "GenerationParams", "WarmOutcome"]

logger = logging.getLogger(__name__)


class Engine:
    """The product's front to the model: requests, batches, warm-up, verification, info and stats."""

    def __init__(self, model, tokenizer, config: EngineConfig, store: ChunkStore, model_id: str = "",
                 weights_id: str = "") -> None:
        self.model_id = model_id or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        # The namespace names the weights, not the name they were asked for by: a catalogue name and a path
        # to the same file share chunks; other weights under the same name never do.
        self.weights_id = weights_id or getattr(model, "kvboost_weights_id", "") or state_fingerprint(model)
        geometry = kv_geometry(model.config)
        refusal = invariant_prefill_refusal(model.config) if config.invariant_prefill else ""
        if refusal:
            raise ValueError(f"invariant prefill cannot run this model: {refusal}; run it without --invariant-prefill")
        counters = EngineStats()
        config = size_tiers(resolve_guard_threshold(config, self.weights_id), model, geometry)  # auto: numbers, logged
        # Rotary parameters for moving stored keys: re-rotating content hits, un-rotating keys before they
        # are quantized and rotating such keys back into place on every hit. None: RoPE that cannot be moved.
        key_rope = _rope_or_none(model.config)
        content_rope = key_rope
        attention = getattr(model.config, "_attn_implementation", None)
        if content_rope is not None and attention not in MASKABLE_ATTENTION:
            logger.info("content hits will not be reused: repair needs %s attention, the model uses %r",
                        " or ".join(MASKABLE_ATTENTION), attention)
            content_rope = None  # content hits then fall back to prefix reuse instead of failing requests
        tiers = build_tiers(config, model, geometry, store)  # handed to the write-back and the parts alike
        self.parts = EngineParts(
            model=model, tokenizer=tokenizer, config=config, store=store,
            namespace=engine_namespace(model, tokenizer, config, self.weights_id),
            geometry=geometry,
            max_prompt_tokens=config.max_prompt_tokens or geometry.max_context,
            eos_ids=eos_token_ids(model, tokenizer), counters=counters,
            writeback=WriteBack(store, config.kv_cache_bits, counters.add_stored, config.kv_group_size,
                                key_rope if config.keys_before_rope else None, config.max_store_stream_bytes,
                                tiers.l0, tiers.host),
            tiers=tiers, key_rope=key_rope, content_rope=content_rope,
            token_cache=token_cache_for(tokenizer, config.tokenizer_cache_bytes),
        )
        use_engine_attention(model)  # after the namespace: the engine's forwards pick grouped SDPA per call
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        limits = SchedulerLimits(*device_limits(self.parts.device.type, config.max_prefill_tokens,
                                                config.max_forward_tokens),
                                 max_running_requests=config.max_running_requests)
        self.core = EngineCore(self.parts, limits, config.max_running_requests, config.kv_cache_bytes, config.max_queue,
                               pad or 0)
        calibrates = config.recompute_when_faster  # None: on CUDA, as the choice itself
        self.calibration = start_calibrated(self.core, self.parts, self.parts.device.type == "cuda"
                                            if calibrates is None else calibrates)

    # What callers read most; everything else is on self.parts.
    model = property(lambda self: self.parts.model)
    tokenizer = property(lambda self: self.parts.tokenizer)
    config = property(lambda self: self.parts.config)
    store = property(lambda self: self.parts.store)
    namespace = property(lambda self: self.parts.namespace)
    geometry = property(lambda self: self.parts.geometry)
    device = property(lambda self: self.parts.device)
    dtype = property(lambda self: self.parts.dtype)

    # ---- the narrow front: submit and forget, reported through on_done ------------------------------

    def submit(self, params: GenerationParams, on_token: OnToken | None, should_stop: ShouldStop,
               on_done: OnDone) -> None:
        """Queues one request (its n completions decode as n rows); on_done(outcomes, None) or on_done(None, error)
        is called once, on the engine's thread, with the outcomes in index order.

        Raises:
            InvalidRequest, PromptTooLong: parameters the server does not accept (nothing is queued).
            QueueFull, EngineStopped: the engine cannot take it now.
        """
        self.core.submit([self._sequence(params, on_token, should_stop, on_done)])

    def submit_batch(self, params_list: Seq[GenerationParams], by_first_chunk: bool, should_stop: ShouldStop,
                     on_done: OnDone) -> None:
        """Queues a batch call's requests (see batch.batch_sequences); on_done(outcomes in input order, None) once."""
        self.core.submit(batch_sequences(self.parts, params_list, by_first_chunk, should_stop, on_done))

    def submit_warm(self, on_done: OnDone, text: str | None = None, messages=None, content_addressed: bool = False,
                    pin: bool = False, cache_salt: str = "", should_stop: ShouldStop = lambda: False) -> None:
        """Queues a warm-up: every chunk of the text (or chat prefix, no generation prompt) computed in budgeted
        pieces like any prefill and stored, the tokens after the last full chunk as a partial chunk; on_done(
        WarmOutcome, None) once stored. content_addressed: chunked as a segment, every chunk also keyed by content.
        cache_salt: stored under that salt's namespace.

        Raises:
            InvalidRequest: neither text nor messages. PromptTooLong: more tokens than max_prompt_tokens.
        """
        parts = salted(self.parts, cache_salt)
        prompt = plan_warm(parts, text, messages, content_addressed)
        if not prompt.num_tokens:  # a text of no tokens: nothing to compute or store
            return on_done(WarmOutcome(0, 0, parts.config.chunk_size, True, 0, ""), None)
        params = GenerationParams(prompt=text or "(messages)", max_new_tokens=1, request_id="warm")
        self.core.submit([EngineRequest(params, None, should_stop, on_done, parts, "prefix_cache", prompt, 0,
                                   warm=WarmSpec(content_addressed, pin), label=" warm")])

    def unpin(self, text: str | None = None, messages=None, content_addressed: bool = False,
              cache_salt: str = "") -> tuple[int, int]:
        """Clears the pins a warm-up of the same arguments set: (chunks unpinned, prompt tokens). Runs no model.

        Raises:
            InvalidRequest, PromptTooLong: as submit_warm. StoreUnavailable: the cache is unreachable.
        """
        prompt = plan_warm(salted(self.parts, cache_salt), text, messages, content_addressed)
        keys = list(prompt.prefix_keys) + ([prompt.tail_key] if prompt.tail_key is not None else [])
        return (self.parts.store.unpin(keys) if keys else 0), prompt.num_tokens

    def start(self) -> None:
        self.core.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Waiting requests fail, running ones finish; then queued write-backs finish."""
        self.core.stop(timeout_s)
        self.parts.writeback.close()

    close = stop

    # ---- blocking calls (tests, benchmarks, in-process use): submit and wait -------------------------

    def generate(self, params: GenerationParams, on_token: OnToken | None = None,
                 should_stop: ShouldStop = lambda: False) -> GenerationOutcome:
        """Runs one request to the end (its first completion when n > 1). Raises as submit, or the request's error."""
        return self.generate_choices(params, on_token, should_stop)[0]

    def generate_choices(self, params: GenerationParams, on_token: OnToken | None = None,
                         should_stop: ShouldStop = lambda: False) -> list[GenerationOutcome]:
        """params.n completions of one prompt (one prefill, n rows decoded together), in index order."""
        return _wait(lambda on_done: self.submit(params, on_token, should_stop, on_done))

    def generate_batch(self, params_list: Seq[GenerationParams], should_stop: ShouldStop = lambda: False,
                       pad_token_id: int | None = None) -> list[GenerationOutcome]:
        """Prompts run together, their common leading chunks prefilled once; input order kept."""
        return _wait(lambda on_done: self.submit_batch(params_list, False, should_stop, on_done))

    def generate_many(self, params_list: Seq[GenerationParams], should_stop: ShouldStop = lambda: False,
                      pad_token_id: int | None = None) -> list[GenerationOutcome]:
        """Prompts grouped by first chunk, each group's common leading chunks prefilled once; input order kept."""
        return _wait(lambda on_done: self.submit_batch(params_list, True, should_stop, on_done))

    def generate_with_first_logits(self, params: GenerationParams) -> tuple[GenerationOutcome, torch.Tensor | None]:
        """generate() without streaming, plus the logits the first token was chosen from ([vocab] float32)."""
        holder: list[EngineRequest] = []

        def submit(on_done: OnDone) -> None:
            holder.append(self._sequence(params, None, lambda: False, on_done))
            self.core.submit(holder)

        outcomes = _wait(submit)
        return outcomes[0], holder[0].first_logits

    def warm(self, text: str | None, messages=None, content_addressed: bool = False, pin: bool = False,
             cache_salt: str = "") -> WarmOutcome:
        """submit_warm, waiting until the chunks are stored. Raises StoreUnavailable when the cache is unreachable."""
        return _wait(lambda on_done: self.submit_warm(on_done, text, messages, content_addressed, pin, cache_salt))

    def _sequence(self, params: GenerationParams, on_token: OnToken | None, should_stop: ShouldStop,
                  on_done: OnDone) -> EngineRequest:
        parts = salted(self.parts, params.cache_salt)
        mode, prompt, max_new_tokens = plan_request(parts, params)
        seq = EngineRequest(params, on_token, should_stop, on_done, parts, mode, prompt, max_new_tokens)
        return seq.ask_early() if self.core.has_room(1) else seq  # a request refused for room costs no Lookup

    def tokenize(self, prompt: str | None = None, messages=None, add_special_tokens: bool = True,
                 add_generation_prompt: bool = True) -> tuple[list[int], list[str]]:
        """(token ids, each token decoded alone) of a prompt or chat, as Generate tokenizes it.

        Raises:
            InvalidRequest: neither or both of prompt and messages.
        """
        if bool(prompt) == bool(messages):
            raise InvalidRequest("Tokenize needs exactly one of prompt and messages")
        cache = token_cache(self.parts)  # the ids Generate prefills come through it: these do too
        if messages:
            GenerationParams(messages=tuple(messages))  # the same check a Generate request's messages get
            token_ids = tokenize_messages(self.tokenizer, messages, add_generation_prompt, cache, self.namespace)[0]
        elif add_special_tokens:
            token_ids = tokenize_prompt(self.tokenizer, prompt, cache, self.namespace)[0]
        else:
            token_ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return token_ids, [token_text(self.tokenizer, token_id) for token_id in token_ids]

    def detokenize(self, token_ids: Seq[int]) -> str:
        """Raises InvalidRequest for ids outside the vocabulary."""
        vocab_size = len(self.tokenizer)
        wrong = [token_id for token_id in token_ids if not 0 <= token_id < vocab_size]
        if wrong:
            raise InvalidRequest(f"token ids {wrong[:5]} are outside the vocabulary (0..{vocab_size - 1})")
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def plan_request(self, params: GenerationParams) -> tuple[str, PromptPlan, int]:
        """(mode, planned prompt, capped max_new_tokens); see engine_parts.planning.plan_request."""
        return plan_request(self.parts, params)

    def repair_options(self, params: GenerationParams | None = None) -> RepairOptions:
        """The request's repair of content hits, the server's defaults where it names none."""
        return repair_options(self.parts, params)

    # ---- warm, verify, info ---------------------------------------------------------------------

    def verify(self, prompts: list[str], max_new_tokens: int = 32, mode: str = "prefix_cache") -> list[dict]:
        """BASELINE against `mode` per prompt (see verification.compare_modes); blocks until every run ended."""
        def run(prompt: str, run_mode: str):
            return self.generate_with_first_logits(
                GenerationParams(prompt=prompt, max_new_tokens=max_new_tokens, mode=run_mode))
        return compare_modes(run, self.flush_writes, prompts or BUILTIN_PROMPTS, mode)

    def model_info(self) -> dict:
        """Fields of ModelInfoReply."""
        names = getattr(self.model.config, "architectures", None) or [type(self.model).__name__]
        return {
            "model": self.model_id, "architecture": names[0], "dtype": dtype_name(self.dtype), "device": str(self.device),
            "num_layers": self.geometry.num_layers, "num_kv_heads": self.geometry.num_kv_heads,
            "head_dim": self.geometry.head_dim, "max_context": self.geometry.max_context,
            "chunk_size": self.config.chunk_size, "kv_cache_bits": self.config.kv_cache_bits,
            "namespace_hex": self.namespace.hex(),
            "weights_id": self.weights_id,
            "default_recompute_strategy": self.config.default_recompute_strategy,
            "default_mode": self.config.default_mode,
        }

    def stats(self) -> dict:
        """Fields of ServiceStatsReply the engine knows: counters, the scheduler's state, `degraded`."""
        return {**self.parts.counters.snapshot(), **self.core.stats(), "degraded": bool(getattr(self.store, "degraded", False)),
                "read_mode": getattr(self.store, "read_mode", ""),  # how cached blobs are read (locked map, stream)
                "stream_fetches": getattr(self.store, "num_stream_fetches", 0),  # fetches over Fetch, not the map
                "writebacks_in_flight": self.parts.writeback.num_in_flight,
                **token_cache_stats(self.parts.token_cache),
                **(self.parts.host.snapshot() if self.parts.host is not None else {})}

    def flush_writes(self, timeout: float | None = None) -> None:
        """Waits for queued write-backs (tests, shutdown)."""
        self.parts.writeback.flush(timeout)


def _wait(submit: Callable[[OnDone], None]):
    """Submits through submit(on_done) and blocks until on_done; returns its result or raises its error."""
    done = threading.Event()
    reported: list = []

    def on_done(result, error) -> None:
        reported.append((result, error))
        done.set()

    submit(on_done)
    done.wait()
    result, error = reported[0]
    if error is not None:
        raise error
    return result


def _rope_or_none(config) -> RopeParams | None:
    """The model's rotary parameters, or None (content hits then fall back to prefix reuse only)."""
    try:
        return rope_parameters(config)
    except (UnsupportedRope, AttributeError, KeyError) as error:
        logger.info("content hits will not be reused by this model: %s", error)
        return None

