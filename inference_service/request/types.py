"""The engine's public types: configuration, one request's parameters, and what a request returns."""
from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field

from inference_service.errors import InvalidRequest
from inference_service.model.step_names import DECODE_STEPS, DEFAULT_DECODE_STEP
from inference_service.store.protocol import DEFAULT_MAX_STREAM_BYTES

MODES = ("baseline", "prefix_cache", "chunk_kv_reuse")
RECOMPUTE_STRATEGIES = ("none", "selective", "cacheblend")
CHAT_ROLES = ("system", "user", "assistant")
FINISH_REASONS = ("eos", "length", "stop", "cancelled")
MAX_TOP_LOGPROBS = 20  # alternatives listed per token at most (OpenAI's limit)
MAX_CHOICES = 16  # completions of one request (rows decoded together)
# Below this a temperature is no distribution a float32 sampler can draw from reliably (the logits divided by it
# overflow); 0 means greedy.
MIN_TEMPERATURE = 1e-6
_FLOAT32_MIN_TEMPERATURE = struct.unpack("<f", struct.pack("<f", MIN_TEMPERATURE))[0]
MAX_STOP_STRINGS = 64  # stop strings per request, each at most MAX_STOP_LENGTH characters
MAX_STOP_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024
SEED_LIMIT = 2**64  # seeds are unsigned 64-bit
INT32_LIMIT = 2**31


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequest(message)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    chunk_size: int = 128
    kv_cache_bits: int = 16
    tenant_salt: str = ""
    max_new_tokens_limit: int = 4096
    max_prompt_tokens: int | None = None  # None: the model's maximum context
    default_mode: str = "prefix_cache"  # exact; chunk_kv_reuse (approximate, labelled) only when asked for
    default_recompute_strategy: str = "selective"
    recompute_ratio: float = 0.15
    selective_tokens: int = 16
    sink_tokens: int = 0  # content-hit tokens among the first N of a prompt are always recomputed
    overlap_tokens: int = 0  # the first N tokens of every content-hit run are recomputed with their real left context
    check_layers: int = 1  # cacheblend: leading layers run on every non-exact token to measure deviation
    guard_threshold: float = 0.0  # cacheblend: recompute every content hit above this risk (0: guard off)
    kv_group_size: int = 0  # quantization group (tokens for keys, channels for values) at 8 and 4 bits; 0: 64 at 8, 128 at 4
    kv_keys_before_rope: bool = False  # at 8 and 4 bits, keys are quantized un-rotated (where the RoPE allows it)
    # The step loop: requests running at once (a request with n completions decodes as n rows, one K/V slot each), the K/V memory they may hold
    # (reserved at admission: prompt + max_new_tokens per row), prompt tokens prefilled per step, prompt tokens of
    # short prefills batched in one forward, and requests waiting before new ones are refused.
    max_running_requests: int = 16
    kv_cache_bytes: int | None = None  # None: auto, sized by the engine from the machine (engine/memory_plan.py)
    max_prefill_tokens: int = 0  # 0: by device (engine/scheduler.device_limits)
    max_forward_tokens: int = 0  # 0: by device
    max_queue: int = 64
    # Generated tokens whose K/V are written back with the prompt's tail when a request ends (its first
    # completion), so a conversation's next turn reuses the answer; 0: answers are not stored.
    max_answer_tokens_stored: int = 1024
    decode_step: str = DEFAULT_DECODE_STEP  # the batched decode step (model/step_names.py)
    max_store_stream_bytes: int = DEFAULT_MAX_STREAM_BYTES  # blob bytes per Store stream of a write-back
    # Slots sized so that their memory stays within kv_cache_bytes (engine/slot_ledger.plan_slots); None: on devices
    # that commit memory at allocation (CUDA), not on a CPU (pages committed as written).
    kv_slots_by_budget: bool | None = None
    # L0: K/V of the chunks written back or fetched, kept in the service's memory (16-bit storage only: quantized
    # blobs do not decode to the computed values); 0: off; None: auto, as kv_cache_bytes.
    l0_bytes: int | None = None
    # The host tier: whole chunks' K/V in one pinned host region that the copy engine reads into slots, fed by L0's
    # evictions and fetched chunks (reuse/host_tier.py); 0: off; None: auto (on CUDA a share of the RAM available,
    # on a CPU off: L0 already is host memory). Off here by default, so that a process building several engines
    # (tests, benchmarks) pins nothing it did not ask for; the service's --host-tier-bytes defaults to auto.
    host_tier_bytes: int | None = 0
    # A request whose cached K/V would load slower than prefilling them (by the measured rates: reuse/tier_rates.py)
    # recomputes them instead; None: on CUDA only (on a CPU loading beats prefill by far for real models, and the
    # tiny test models' rates are mostly fixed costs).
    recompute_when_faster: bool | None = None
    # Token ids of long pieces of prompt text (between special tokens) kept so a repeated system prompt, document or
    # earlier turn is not tokenized again (kvboost_keys/token_cache.py); 0: off.
    tokenizer_cache_bytes: int = 64 << 20
    # Every prefill forward is one chunk of rows at chunk-aligned positions (the last padded), so a chunk's K/V do
    # not depend on how its prompt was cut or what was cached: cached answers bitwise the uncached ones in bf16 and
    # fp16 too, where GEMMs and attention round by their rows. Costs smaller forwards; full-attention models only.
    invariant_prefill: bool = False
    # With invariant_prefill, each forward runs this many whole chunks at positions aligned to as many (the stored
    # chunks keep chunk_size): fewer, larger forwards read the weights fewer times (a GPU's cost), at the price of up
    # to this many chunks recomputed after a cached run and a last piece padded to its end. Part of the namespace.
    invariant_piece_chunks: int = 1
    # With invariant_prefill, decode steps whose rows do not depend on their neighbours (every slot a row, blockwise
    # attention: model/step_runner.py); None: on CUDA in bf16/fp16 (on a CPU a padded step costs several times a
    # step, docs/performance.md; in fp32 the default step keeps model.generate's tokens, which this one need not).
    invariant_decode: bool | None = None

    @property
    def invariant_piece_tokens(self) -> int:
        """Tokens of one invariant prefill forward (chunk_size x invariant_piece_chunks); 1 without it."""
        return self.chunk_size * self.invariant_piece_chunks if self.invariant_prefill else 1

    @property
    def keys_before_rope(self) -> bool:
        return self.kv_keys_before_rope and self.kv_cache_bits != 16

    def __post_init__(self) -> None:
        assert self.chunk_size > 0, f"chunk_size must be positive, got {self.chunk_size}"
        assert self.kv_cache_bits in (4, 8, 16), f"kv_cache_bits must be 4, 8 or 16, got {self.kv_cache_bits}"
        assert self.max_new_tokens_limit > 0, f"max_new_tokens_limit must be positive, got {self.max_new_tokens_limit}"
        assert self.max_prompt_tokens is None or self.max_prompt_tokens > 0, "max_prompt_tokens must be positive"
        assert self.default_mode in MODES, f"default_mode must be one of {MODES}, got {self.default_mode!r}"
        assert self.default_recompute_strategy in RECOMPUTE_STRATEGIES, (
            f"default_recompute_strategy must be one of {RECOMPUTE_STRATEGIES}, got {self.default_recompute_strategy!r}")
        assert 0.0 < self.recompute_ratio <= 1.0, f"recompute_ratio must be in (0, 1], got {self.recompute_ratio}"
        assert self.guard_threshold >= 0.0, f"guard_threshold must be >= 0, got {self.guard_threshold}"
        assert self.selective_tokens >= 0, f"selective_tokens must be >= 0, got {self.selective_tokens}"
        assert self.sink_tokens >= 0, f"sink_tokens must be >= 0, got {self.sink_tokens}"
        assert self.overlap_tokens >= 0, f"overlap_tokens must be >= 0, got {self.overlap_tokens}"
        assert self.check_layers >= 1, f"check_layers must be >= 1, got {self.check_layers}"
        assert self.max_running_requests > 0, f"max_running_requests must be positive, got {self.max_running_requests}"
        assert self.kv_cache_bytes is None or self.kv_cache_bytes > 0, (
            f"kv_cache_bytes must be positive (None: auto), got {self.kv_cache_bytes}")
        assert self.max_prefill_tokens >= 0, f"max_prefill_tokens must be >= 0 (0: by device), got {self.max_prefill_tokens}"
        assert self.max_forward_tokens >= 0, f"max_forward_tokens must be >= 0 (0: by device), got {self.max_forward_tokens}"
        assert self.max_queue > 0, f"max_queue must be positive, got {self.max_queue}"
        assert self.max_answer_tokens_stored >= 0, "max_answer_tokens_stored must be >= 0"
        assert self.l0_bytes is None or self.l0_bytes >= 0, (
            f"l0_bytes must be >= 0 (None: auto), got {self.l0_bytes}")
        assert self.host_tier_bytes is None or self.host_tier_bytes >= 0, (
            f"host_tier_bytes must be >= 0 (None: auto), got {self.host_tier_bytes}")
        assert self.tokenizer_cache_bytes >= 0, f"tokenizer_cache_bytes must be >= 0, got {self.tokenizer_cache_bytes}"
        assert self.max_store_stream_bytes > 0, f"max_store_stream_bytes must be positive, got {self.max_store_stream_bytes}"
        assert 0 <= self.kv_group_size <= 65535, f"kv_group_size must be in 0..65535, got {self.kv_group_size}"
        if self.invariant_decode and not self.invariant_prefill:
            raise ValueError("invariant_decode is part of the invariant path: turn on invariant_prefill too (a decode "
                             "step alone cannot make an answer independent of the cache)")
        if self.invariant_piece_chunks < 1:
            raise ValueError(f"invariant_piece_chunks must be >= 1 (chunks per invariant prefill forward), got "
                             f"{self.invariant_piece_chunks}")
        assert self.decode_step in DECODE_STEPS, f"decode_step must be one of {DECODE_STEPS}, got {self.decode_step!r}"


@dataclass(slots=True, frozen=True)
class GenerationParams:
    """One Generate request. Exactly one of prompt, messages, segments is given; raises InvalidRequest."""

    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs
    segments: tuple[str, ...] | None = None
    max_new_tokens: int = 64
    mode: str | None = None  # None: the engine's default mode
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: a random seed
    stop: tuple[str, ...] = ()
    recompute_strategy: str | None = None
    recompute_ratio: float | None = None
    selective_tokens: int | None = None
    sink_tokens: int | None = None
    request_id: str = ""
    arrival: float = field(default_factory=time.perf_counter)  # time.perf_counter() when the request arrived
    logprobs: int | None = None  # None: off; k: each generated token's logprob and its k best alternatives
    prompt_logprobs: int | None = None  # None: off; k: every prompt token's logprob with k alternatives
    n: int = 1  # completions sampled from the one prefilled prompt
    cache_salt: str = ""  # mixed into the cache namespace (kvboost_keys.namespace.salted_namespace)
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    strict_context: bool = False  # InvalidRequest when prompt + max_new_tokens exceeds the context (else capped)

    def __post_init__(self) -> None:
        given = [name for name in ("prompt", "messages", "segments") if getattr(self, name)]
        _require(len(given) == 1, f"exactly one of prompt, messages, segments must be given, got {given or 'none'}")
        if self.messages:
            for role, content in self.messages:
                _require(role in CHAT_ROLES, f"message role must be one of {CHAT_ROLES}, got {role!r}")
                _require(isinstance(content, str), "message content must be text")
        if self.segments:
            _require(any(self.segments), "segments must not all be empty")
        _require(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _require(self.mode is None or self.mode in MODES, f"mode must be one of {MODES}, got {self.mode!r}")
        _require(math.isfinite(self.temperature) and self.temperature >= 0.0,
                 f"temperature must be finite and >= 0, got {self.temperature}")
        # >= the float32 nearest MIN_TEMPERATURE: the proto carries float32, whose 1e-6 is just below 1e-6
        _require(self.temperature == 0.0 or self.temperature >= _FLOAT32_MIN_TEMPERATURE,
                 f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}: below it the logits divided by it "
                 f"overflow float32; got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(0 <= self.top_k < INT32_LIMIT, f"top_k must be in 0..{INT32_LIMIT - 1}, got {self.top_k}")
        _require(self.seed is None or 0 <= self.seed < SEED_LIMIT, f"seed must be in 0..{SEED_LIMIT - 1}, got {self.seed}")
        _require(all(self.stop), "stop strings must not be empty")
        _require(len(self.stop) <= MAX_STOP_STRINGS and all(len(stop) <= MAX_STOP_LENGTH for stop in self.stop),
                 f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LENGTH} characters each")
        _require(self.max_new_tokens < INT32_LIMIT, f"max_new_tokens must be below {INT32_LIMIT}")
        _require(self.recompute_strategy is None or self.recompute_strategy in RECOMPUTE_STRATEGIES,
                 f"recompute_strategy must be one of {RECOMPUTE_STRATEGIES}, got {self.recompute_strategy!r}")
        _require(self.recompute_ratio is None or 0.0 < self.recompute_ratio <= 1.0,
                 f"recompute_ratio must be in (0, 1], got {self.recompute_ratio}")
        _require(self.selective_tokens is None or self.selective_tokens >= 0,
                 f"selective_tokens must be >= 0, got {self.selective_tokens}")
        _require(self.sink_tokens is None or self.sink_tokens >= 0, f"sink_tokens must be >= 0, got {self.sink_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or 0 <= value <= MAX_TOP_LOGPROBS,
                     f"{name} must be in 0..{MAX_TOP_LOGPROBS} alternatives, got {value}")
        _require(1 <= self.n <= MAX_CHOICES, f"n must be in 1..{MAX_CHOICES}, got {self.n}")
        _require(0 <= self.min_tokens <= self.max_new_tokens,
                 f"min_tokens must be in 0..max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}")
        _require(all(0 <= token_id < INT32_LIMIT for token_id in self.stop_token_ids)
                 and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                 f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, each in 0..{INT32_LIMIT - 1}")


@dataclass(slots=True, frozen=True)
class TopLogprob:
    token_id: int
    text: str  # the token alone, decoded
    logprob: float


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One token's log-probability (natural log, float32 log-softmax of the logits it was chosen from)."""

    token_id: int
    text: str  # the token alone, decoded
    logprob: float | None  # None for a prompt's first token (nothing predicts it)
    top: tuple[TopLogprob, ...] = ()  # the most likely alternatives, best first


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """What one decode step streams: text it completes (maybe empty) and the tokens it covers."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them
    index: int = 0  # which of the request's n completions
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on the first event only, when asked for
    # On each completion's first token: its prompt used content hits (GenerationOutcome.approximate).
    approximate: bool = False
    approximate_tokens: int = 0


@dataclass(slots=True)
class GenerationOutcome:
    output_text: str
    generated_tokens: int
    output_token_ids: list[int]
    ttft_ms: float  # request arrival -> first token chosen
    total_ms: float  # request arrival -> last token chosen
    tokens_per_sec: float  # decode rate after the first token
    kv_reuse_ratio: float  # cached_tokens / prompt_tokens
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    mode: str
    finish_reason: str  # one of FINISH_REASONS
    degraded: bool  # the cache was unreachable for this request
    request_id: str
    index: int = 0  # which of the request's n completions
    repair_risk: float = 0.0  # cacheblend: check-layer K/V error left unrepaired (share)
    fidelity_guard: bool = False  # the guard recomputed every content-hit token
    # K/V computed under another prefix (content hits) went into this answer; the prompt tokens it kept unrecomputed.
    approximate: bool = False
    approximate_tokens: int = 0


@dataclass(slots=True, frozen=True)
class WarmOutcome:
    chunks_stored: int
    token_count: int
    chunk_size: int
    chunk_boundary_aligned: bool
    partial_tail_tokens: int
    alignment_warning: str
