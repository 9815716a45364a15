"""Plain result types mirroring the proto replies field for field (enums as names, digests as hex)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def message_to_dict(message: Message) -> dict[str, Any]:
    """Every field of `message` by its proto name, unset ones at their defaults.

    Enums become their value names, bytes become lowercase hex, 64-bit integers stay ints (unlike
    json_format, which writes them as strings), optional fields that are not set become None.
    """
    values: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if _is_repeated(field):
            values[field.name] = [_convert_scalar(field, item) for item in value]
        elif field.has_presence and not message.HasField(field.name):
            values[field.name] = None
        else:
            values[field.name] = _convert_scalar(field, value)
    return values


def _is_repeated(field: FieldDescriptor) -> bool:
    # `is_repeated` is the newer spelling; `label` is deprecated but still present in older releases.
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def _convert_scalar(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_value = field.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return bytes(value).hex()
    return value


class _FromProto:
    """Builds a frozen dataclass from a proto message of the same shape."""

    __slots__ = ()
    # field name -> result type of each nested message field (repeated or singular)
    _nested: ClassVar[dict[str, type]] = {}

    @classmethod
    def from_proto(cls, message: Message):
        return cls.from_dict(message_to_dict(message))

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        kwargs = {}
        for field in fields(cls):
            value = values[field.name]
            if field.name in cls._nested and isinstance(value, list):
                value = tuple(cls._nested[field.name].from_dict(item) for item in value)
            elif field.name in cls._nested and value is not None:
                value = cls._nested[field.name].from_dict(value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[field.name] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The proto field names and values, ready for json.dumps."""
        return asdict(self)


@dataclass(slots=True, frozen=True)
class GenerationResult(_FromProto):
    output_text: str
    generated_tokens: int
    ttft_ms: float
    total_ms: float
    tokens_per_sec: float
    kv_reuse_ratio: float
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    mode: str
    finish_reason: str
    output_token_ids: tuple[int, ...]
    degraded: bool
    request_id: str
    index: int  # which of the request's n completions
    repair_risk: float  # cacheblend: check-layer K/V error left unrepaired (share)
    fidelity_guard: bool  # the fidelity guard recomputed every content-hit token
    approximate: bool  # content hits (K/V computed under another prefix) went into the answer: may differ from baseline
    approximate_tokens: int  # prompt tokens whose K/V came from content hits and were not recomputed


@dataclass(slots=True, frozen=True)
class WarmResult(_FromProto):
    chunks_stored: int
    token_count: int
    chunk_size: int
    chunk_boundary_aligned: bool
    partial_tail_tokens: int
    alignment_warning: str


@dataclass(slots=True, frozen=True)
class PromptVerification(_FromProto):
    prompt: str
    token_identical: bool
    first_token_cosine: float
    first_token_kl: float
    matching_prefix_tokens: int
    cached_tokens: int
    baseline_text: str
    cached_text: str


@dataclass(slots=True, frozen=True)
class VerifyReport(_FromProto):
    _nested: ClassVar[dict[str, type]] = {"prompts": PromptVerification}

    prompts: tuple[PromptVerification, ...]
    identical: int
    total: int


@dataclass(slots=True, frozen=True)
class TierLoad(_FromProto):
    tier: str  # l0, daemon_map, daemon_fetch, store
    chunks: int
    bytes: int
    seconds: float  # bytes / seconds: the tier's load rate
    loads: int  # requests it placed chunks for


@dataclass(slots=True, frozen=True)
class ServiceStats(_FromProto):
    _nested: ClassVar[dict[str, type]] = {"tier_loads": TierLoad}

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
    running_rows: int  # the step loop: rows decoding, requests waiting, K/V reserved and its budget
    waiting_requests: int
    kv_bytes_in_use: int
    kv_budget_bytes: int
    read_mode: str  # "locked_map", "stream" or "remote": how the service reads cached blobs
    stream_fetches: int
    partial_cached_tokens: int  # of cached_tokens, those from stored partial chunks
    computed_tokens: int  # prompt tokens prefilled
    guard_checks: int  # requests whose content hits the fidelity guard measured
    guard_fallbacks: int  # of those, sent to full recompute
    approximate_answers: int  # answers that reused content hits (labelled approximate)
    approximate_tokens: int  # their prompt tokens from content hits, not recomputed
    l0_chunks_hit: int  # whole chunks placed from L0, the service's own tier
    l0_bytes_placed: int
    l0_bytes_held: int
    l0_chunks_held: int
    l0_chunks_evicted: int
    load_bytes: int  # K/V bytes placed from the cache; load_bytes / load_seconds: the load rate
    load_seconds: float
    l0_chunks_rejected: int = 0  # chunks L0 did not keep (only their own prefix could have made room)
    tier_loads: tuple[TierLoad, ...] = ()  # per tier: chunks, bytes, seconds, loads
    loads_skipped: int = 0  # requests that recomputed cached tokens their tier would load slower
    load_skipped_tokens: int = 0
    tokenizer_cache_hits: int = 0  # prompt pieces whose token ids came from the tokenization cache
    tokenizer_cache_misses: int = 0
    tokenizer_cache_hit_tokens: int = 0
    tokenizer_cache_bytes: int = 0
    step_loop_lookups: int = 0  # Lookups the step loop asked itself (none at submission, or out of date)
    writebacks_in_flight: int = 0  # write-backs queued or running now (0: everything answered so far is kept)
    l0_chunks_alone: int = 0  # whole chunks L0 answered for alone: the daemon no longer held them (no Delete since)


@dataclass(slots=True, frozen=True)
class UnpinResult(_FromProto):
    chunks_unpinned: int
    token_count: int


@dataclass(slots=True, frozen=True)
class ModelInfo(_FromProto):
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
    default_recompute_strategy: str
    weights_id: str  # the weights' fingerprint (docs/models.md)
    default_mode: str  # the mode of requests that name none: prefix_cache (exact) unless the service opted in


@dataclass(slots=True, frozen=True)
class NamespaceStats(_FromProto):
    namespace: str  # hex
    entries: int
    bytes: int
    pinned: int


@dataclass(slots=True, frozen=True)
class L2Stats(_FromProto):
    url: str  # password removed
    degraded: bool
    hits: int
    misses: int
    writes: int
    dropped_writes: int
    corrupted: int
    errors: int
    queued_writes: int
    forged: int = 0  # records whose MAC failed (served as misses)
    promotion_batches: int = 0
    calls_in_flight: int = 0
    promoted: int = 0  # chunks whose values followed a Lookup into LMDB
    promoted_bytes: int = 0
    not_arrived: int = 0  # reported by a Lookup, never arrived (a reader's run ended there)
    arrival_waits: int = 0  # Fetch reads that waited for a chunk still arriving
    arriving: int = 0
    seconds: float = 0.0  # time spent on L2


@dataclass(slots=True, frozen=True)
class CacheStats(_FromProto):
    _nested: ClassVar[dict[str, type]] = {"namespaces": NamespaceStats, "l2": L2Stats}

    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int
    corrupted: int
    bytes_read: int
    bytes_written: int
    map_size: int
    namespaces: tuple[NamespaceStats, ...]
    l2: L2Stats | None  # None when the daemon runs without --l2


@dataclass(slots=True, frozen=True)
class DeleteResult(_FromProto):
    deleted: int
    bytes_freed: int


@dataclass(slots=True, frozen=True)
class PinResult(_FromProto):
    updated: int
    missing: tuple[str, ...]  # hex keys that are not stored
