"""The engine's public types: one request's parameters and what a request returns (its configuration: config.py)."""
from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field

# EngineConfig is declared in inference_service/config.py; named here too, where the engine's types are imported from.
from inference_service.config import MODES, RECOMPUTE_STRATEGIES, EngineConfig  # noqa: F401
from inference_service.errors import InvalidRequest

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
