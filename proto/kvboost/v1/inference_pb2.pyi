from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    BASELINE: _ClassVar[Mode]
    PREFIX_CACHE: _ClassVar[Mode]
    CHUNK_KV_REUSE: _ClassVar[Mode]

class RecomputeStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECOMPUTE_STRATEGY_UNSPECIFIED: _ClassVar[RecomputeStrategy]
    NONE: _ClassVar[RecomputeStrategy]
    SELECTIVE: _ClassVar[RecomputeStrategy]
    CACHEBLEND: _ClassVar[RecomputeStrategy]
MODE_UNSPECIFIED: Mode
BASELINE: Mode
PREFIX_CACHE: Mode
CHUNK_KV_REUSE: Mode
RECOMPUTE_STRATEGY_UNSPECIFIED: RecomputeStrategy
NONE: RecomputeStrategy
SELECTIVE: RecomputeStrategy
CACHEBLEND: RecomputeStrategy

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "segments", "max_new_tokens", "mode", "temperature", "top_p", "top_k", "seed", "stop", "recompute_strategy", "recompute_ratio", "selective_tokens", "request_id", "sink_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "n", "cache_salt", "min_tokens", "ignore_eos", "stop_token_ids", "strict_context")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    SELECTIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRICT_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    segments: _containers.RepeatedScalarFieldContainer[str]
    max_new_tokens: int
    mode: Mode
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    recompute_strategy: RecomputeStrategy
    recompute_ratio: float
    selective_tokens: int
    request_id: str
    sink_tokens: int
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: int
    n: int
    cache_salt: str
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    strict_context: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., segments: _Optional[_Iterable[str]] = ..., max_new_tokens: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., recompute_strategy: _Optional[_Union[RecomputeStrategy, str]] = ..., recompute_ratio: _Optional[float] = ..., selective_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., sink_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., cache_salt: _Optional[str] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., strict_context: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "text", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerationResult(_message.Message):
    __slots__ = ("output_text", "generated_tokens", "ttft_ms", "total_ms", "tokens_per_sec", "kv_reuse_ratio", "prompt_tokens", "cached_tokens", "recomputed_tokens", "mode", "finish_reason", "output_token_ids", "degraded", "request_id", "index", "repair_risk", "fidelity_guard", "approximate", "approximate_tokens")
    OUTPUT_TEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    KV_REUSE_RATIO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REPAIR_RISK_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_GUARD_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    output_text: str
    generated_tokens: int
    ttft_ms: float
    total_ms: float
    tokens_per_sec: float
    kv_reuse_ratio: float
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    mode: Mode
    finish_reason: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    degraded: bool
    request_id: str
    index: int
    repair_risk: float
    fidelity_guard: bool
    approximate: bool
    approximate_tokens: int
    def __init__(self, output_text: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., tokens_per_sec: _Optional[float] = ..., kv_reuse_ratio: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., finish_reason: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., degraded: _Optional[bool] = ..., request_id: _Optional[str] = ..., index: _Optional[int] = ..., repair_risk: _Optional[float] = ..., fidelity_guard: _Optional[bool] = ..., approximate: _Optional[bool] = ..., approximate_tokens: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("text", "token_ids", "result", "index", "logprobs", "prompt_logprobs", "approximate", "approximate_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    result: GenerationResult
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    approximate: bool
    approximate_tokens: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., result: _Optional[_Union[GenerationResult, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., approximate: _Optional[bool] = ..., approximate_tokens: _Optional[int] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ...) -> None: ...

class GenerateBatchReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GenerationResult]
    def __init__(self, results: _Optional[_Iterable[_Union[GenerationResult, _Mapping]]] = ...) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ("text", "content_addressed", "messages", "pin", "cache_salt")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ADDRESSED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    text: str
    content_addressed: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    pin: bool
    cache_salt: str
    def __init__(self, text: _Optional[str] = ..., content_addressed: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., pin: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class WarmResult(_message.Message):
    __slots__ = ("chunks_stored", "token_count", "chunk_size", "chunk_boundary_aligned", "partial_tail_tokens", "alignment_warning")
    CHUNKS_STORED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BOUNDARY_ALIGNED_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_TAIL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_WARNING_FIELD_NUMBER: _ClassVar[int]
    chunks_stored: int
    token_count: int
    chunk_size: int
    chunk_boundary_aligned: bool
    partial_tail_tokens: int
    alignment_warning: str
    def __init__(self, chunks_stored: _Optional[int] = ..., token_count: _Optional[int] = ..., chunk_size: _Optional[int] = ..., chunk_boundary_aligned: _Optional[bool] = ..., partial_tail_tokens: _Optional[int] = ..., alignment_warning: _Optional[str] = ...) -> None: ...

class UnpinResult(_message.Message):
    __slots__ = ("chunks_unpinned", "token_count")
    CHUNKS_UNPINNED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    chunks_unpinned: int
    token_count: int
    def __init__(self, chunks_unpinned: _Optional[int] = ..., token_count: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("prompts", "max_new_tokens", "mode")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedScalarFieldContainer[str]
    max_new_tokens: int
    mode: Mode
    def __init__(self, prompts: _Optional[_Iterable[str]] = ..., max_new_tokens: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ...) -> None: ...

class PromptVerification(_message.Message):
    __slots__ = ("prompt", "token_identical", "first_token_cosine", "first_token_kl", "matching_prefix_tokens", "cached_tokens", "baseline_text", "cached_text")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDENTICAL_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_COSINE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_KL_FIELD_NUMBER: _ClassVar[int]
    MATCHING_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BASELINE_TEXT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TEXT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_identical: bool
    first_token_cosine: float
    first_token_kl: float
    matching_prefix_tokens: int
    cached_tokens: int
    baseline_text: str
    cached_text: str
    def __init__(self, prompt: _Optional[str] = ..., token_identical: _Optional[bool] = ..., first_token_cosine: _Optional[float] = ..., first_token_kl: _Optional[float] = ..., matching_prefix_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., baseline_text: _Optional[str] = ..., cached_text: _Optional[str] = ...) -> None: ...

class VerifyReport(_message.Message):
    __slots__ = ("prompts", "identical", "total")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    IDENTICAL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[PromptVerification]
    identical: int
    total: int
    def __init__(self, prompts: _Optional[_Iterable[_Union[PromptVerification, _Mapping]]] = ..., identical: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class ServiceStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceStatsReply(_message.Message):
    __slots__ = ("requests", "rejected", "prompt_tokens", "cached_tokens", "recomputed_tokens", "chunks_fetched", "chunks_stored", "bytes_fetched", "bytes_stored", "degraded", "cache_address", "queue_depth", "mean_ttft_ms", "running_rows", "waiting_requests", "kv_bytes_in_use", "kv_budget_bytes", "read_mode", "stream_fetches", "partial_cached_tokens", "computed_tokens", "guard_checks", "guard_fallbacks", "approximate_answers", "approximate_tokens", "l0_chunks_hit", "l0_bytes_placed", "l0_bytes_held", "l0_chunks_held", "l0_chunks_evicted", "load_bytes", "load_seconds", "l0_chunks_rejected", "tier_loads", "loads_skipped", "load_skipped_tokens", "tokenizer_cache_hits", "tokenizer_cache_misses", "tokenizer_cache_hit_tokens", "tokenizer_cache_bytes", "step_loop_lookups", "writebacks_in_flight", "l0_chunks_alone")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    CACHE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MEAN_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_ROWS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_MODE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FETCHES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUARD_CHECKS_FIELD_NUMBER: _ClassVar[int]
    GUARD_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    L0_CHUNKS_HIT_FIELD_NUMBER: _ClassVar[int]
    L0_BYTES_PLACED_FIELD_NUMBER: _ClassVar[int]
    L0_BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    L0_CHUNKS_HELD_FIELD_NUMBER: _ClassVar[int]
    L0_CHUNKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    L0_CHUNKS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    TIER_LOADS_FIELD_NUMBER: _ClassVar[int]
    LOADS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    LOAD_SKIPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_LOOP_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    WRITEBACKS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    L0_CHUNKS_ALONE_FIELD_NUMBER: _ClassVar[int]
    requests: int
    rejected: int
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    chunks_fetched: int
    chunks_stored: int
    bytes_fetched: int
    bytes_stored: int
    degraded: bool
    cache_address: str
    queue_depth: int
    mean_ttft_ms: float
    running_rows: int
    waiting_requests: int
    kv_bytes_in_use: int
    kv_budget_bytes: int
    read_mode: str
    stream_fetches: int
    partial_cached_tokens: int
    computed_tokens: int
    guard_checks: int
    guard_fallbacks: int
    approximate_answers: int
    approximate_tokens: int
    l0_chunks_hit: int
    l0_bytes_placed: int
    l0_bytes_held: int
    l0_chunks_held: int
    l0_chunks_evicted: int
    load_bytes: int
    load_seconds: float
    l0_chunks_rejected: int
    tier_loads: _containers.RepeatedCompositeFieldContainer[TierLoad]
    loads_skipped: int
    load_skipped_tokens: int
    tokenizer_cache_hits: int
    tokenizer_cache_misses: int
    tokenizer_cache_hit_tokens: int
    tokenizer_cache_bytes: int
    step_loop_lookups: int
    writebacks_in_flight: int
    l0_chunks_alone: int
    def __init__(self, requests: _Optional[int] = ..., rejected: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., chunks_fetched: _Optional[int] = ..., chunks_stored: _Optional[int] = ..., bytes_fetched: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., degraded: _Optional[bool] = ..., cache_address: _Optional[str] = ..., queue_depth: _Optional[int] = ..., mean_ttft_ms: _Optional[float] = ..., running_rows: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_bytes_in_use: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., read_mode: _Optional[str] = ..., stream_fetches: _Optional[int] = ..., partial_cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., guard_checks: _Optional[int] = ..., guard_fallbacks: _Optional[int] = ..., approximate_answers: _Optional[int] = ..., approximate_tokens: _Optional[int] = ..., l0_chunks_hit: _Optional[int] = ..., l0_bytes_placed: _Optional[int] = ..., l0_bytes_held: _Optional[int] = ..., l0_chunks_held: _Optional[int] = ..., l0_chunks_evicted: _Optional[int] = ..., load_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., l0_chunks_rejected: _Optional[int] = ..., tier_loads: _Optional[_Iterable[_Union[TierLoad, _Mapping]]] = ..., loads_skipped: _Optional[int] = ..., load_skipped_tokens: _Optional[int] = ..., tokenizer_cache_hits: _Optional[int] = ..., tokenizer_cache_misses: _Optional[int] = ..., tokenizer_cache_hit_tokens: _Optional[int] = ..., tokenizer_cache_bytes: _Optional[int] = ..., step_loop_lookups: _Optional[int] = ..., writebacks_in_flight: _Optional[int] = ..., l0_chunks_alone: _Optional[int] = ...) -> None: ...

class TierLoad(_message.Message):
    __slots__ = ("tier", "chunks", "bytes", "seconds", "loads")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    chunks: int
    bytes: int
    seconds: float
    loads: int
    def __init__(self, tier: _Optional[str] = ..., chunks: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., loads: _Optional[int] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoReply(_message.Message):
    __slots__ = ("model", "architecture", "dtype", "device", "num_layers", "num_kv_heads", "head_dim", "max_context", "chunk_size", "kv_cache_bits", "namespace_hex", "default_recompute_strategy", "weights_id", "default_mode")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BITS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_HEX_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_RECOMPUTE_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    dtype: str
    device: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    chunk_size: int
    kv_cache_bits: int
    namespace_hex: str
    default_recompute_strategy: RecomputeStrategy
    weights_id: str
    default_mode: Mode
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_context: _Optional[int] = ..., chunk_size: _Optional[int] = ..., kv_cache_bits: _Optional[int] = ..., namespace_hex: _Optional[str] = ..., default_recompute_strategy: _Optional[_Union[RecomputeStrategy, str]] = ..., weights_id: _Optional[str] = ..., default_mode: _Optional[_Union[Mode, str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "add_special_tokens", "add_generation_prompt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_special_tokens: bool
    add_generation_prompt: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenizeReply(_message.Message):
    __slots__ = ("token_ids", "tokens", "max_context")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    max_context: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ..., max_context: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeReply(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
