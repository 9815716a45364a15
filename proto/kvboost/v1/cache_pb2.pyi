from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_STORED: _ClassVar[KvEventKind]
    KV_EVENT_PROMOTED: _ClassVar[KvEventKind]
    KV_EVENT_EVICTED: _ClassVar[KvEventKind]
    KV_EVENT_DELETED: _ClassVar[KvEventKind]
    KV_EVENT_CLEARED: _ClassVar[KvEventKind]

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KvTier]
    KV_TIER_L1: _ClassVar[KvTier]
    KV_TIER_L2: _ClassVar[KvTier]
KV_EVENT_UNSPECIFIED: KvEventKind
KV_EVENT_STORED: KvEventKind
KV_EVENT_PROMOTED: KvEventKind
KV_EVENT_EVICTED: KvEventKind
KV_EVENT_DELETED: KvEventKind
KV_EVENT_CLEARED: KvEventKind
KV_TIER_UNSPECIFIED: KvTier
KV_TIER_L1: KvTier
KV_TIER_L2: KvTier

class ChunkMeta(_message.Message):
    __slots__ = ("key", "namespace", "content_key", "num_tokens", "size_bytes", "checksum", "frequency", "last_access_unix", "pinned", "parent_key", "token_ids", "delete_epoch_id", "delete_count")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_UNIX_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DELETE_EPOCH_ID_FIELD_NUMBER: _ClassVar[int]
    DELETE_COUNT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    namespace: bytes
    content_key: bytes
    num_tokens: int
    size_bytes: int
    checksum: int
    frequency: float
    last_access_unix: float
    pinned: bool
    parent_key: bytes
    token_ids: bytes
    delete_epoch_id: str
    delete_count: int
    def __init__(self, key: _Optional[bytes] = ..., namespace: _Optional[bytes] = ..., content_key: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., frequency: _Optional[float] = ..., last_access_unix: _Optional[float] = ..., pinned: _Optional[bool] = ..., parent_key: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., delete_epoch_id: _Optional[str] = ..., delete_count: _Optional[int] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("meta", "found")
    META_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    meta: ChunkMeta
    found: bool
    def __init__(self, meta: _Optional[_Union[ChunkMeta, _Mapping]] = ..., found: _Optional[bool] = ...) -> None: ...

class ChunkFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "prefix_keys", "content_keys", "partial_keys", "continue_parent", "continue_tokens", "continue_after_run")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_KEYS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_PARENT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_AFTER_RUN_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    prefix_keys: _containers.RepeatedScalarFieldContainer[bytes]
    content_keys: _containers.RepeatedScalarFieldContainer[bytes]
    partial_keys: _containers.RepeatedScalarFieldContainer[bytes]
    continue_parent: bytes
    continue_tokens: bytes
    continue_after_run: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., prefix_keys: _Optional[_Iterable[bytes]] = ..., content_keys: _Optional[_Iterable[bytes]] = ..., partial_keys: _Optional[_Iterable[bytes]] = ..., continue_parent: _Optional[bytes] = ..., continue_tokens: _Optional[bytes] = ..., continue_after_run: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ContentHit(_message.Message):
    __slots__ = ("index", "stored_key")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STORED_KEY_FIELD_NUMBER: _ClassVar[int]
    index: int
    stored_key: bytes
    def __init__(self, index: _Optional[int] = ..., stored_key: _Optional[bytes] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("prefix_run", "prefix_hit", "content_hits", "partial_index", "continuation_key", "continuation_tokens", "continued", "partial_key", "partial_tokens", "delete_epoch_id", "delete_count")
    PREFIX_RUN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HITS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_KEY_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_KEY_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELETE_EPOCH_ID_FIELD_NUMBER: _ClassVar[int]
    DELETE_COUNT_FIELD_NUMBER: _ClassVar[int]
    prefix_run: int
    prefix_hit: _containers.RepeatedScalarFieldContainer[bool]
    content_hits: _containers.RepeatedCompositeFieldContainer[ContentHit]
    partial_index: int
    continuation_key: bytes
    continuation_tokens: int
    continued: bool
    partial_key: bytes
    partial_tokens: int
    delete_epoch_id: str
    delete_count: int
    def __init__(self, prefix_run: _Optional[int] = ..., prefix_hit: _Optional[_Iterable[bool]] = ..., content_hits: _Optional[_Iterable[_Union[ContentHit, _Mapping]]] = ..., partial_index: _Optional[int] = ..., continuation_key: _Optional[bytes] = ..., continuation_tokens: _Optional[int] = ..., continued: _Optional[bool] = ..., partial_key: _Optional[bytes] = ..., partial_tokens: _Optional[int] = ..., delete_epoch_id: _Optional[str] = ..., delete_count: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("keys", "reader_verifies")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    READER_VERIFIES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    reader_verifies: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., reader_verifies: _Optional[bool] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("stored", "already_present", "evicted", "bytes_stored", "superseded")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    evicted: int
    bytes_stored: int
    superseded: int
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ..., evicted: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., superseded: _Optional[int] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    def __init__(self, namespace: _Optional[bytes] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "entries", "bytes", "pinned")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    entries: int
    bytes: int
    pinned: int
    def __init__(self, namespace: _Optional[bytes] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., pinned: _Optional[int] = ...) -> None: ...

class CacheStatsReply(_message.Message):
    __slots__ = ("entries", "bytes", "max_bytes", "hits", "misses", "evictions", "corrupted", "bytes_read", "bytes_written", "map_size", "namespaces", "l2")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    MAP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    L2_FIELD_NUMBER: _ClassVar[int]
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
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    l2: L2Stats
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupted: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., map_size: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., l2: _Optional[_Union[L2Stats, _Mapping]] = ...) -> None: ...

class L2Stats(_message.Message):
    __slots__ = ("url", "degraded", "hits", "misses", "writes", "dropped_writes", "corrupted", "errors", "queued_writes", "forged", "promotion_batches", "calls_in_flight", "promoted", "promoted_bytes", "not_arrived", "arrival_waits", "arriving", "seconds")
    URL_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_WRITES_FIELD_NUMBER: _ClassVar[int]
    FORGED_FIELD_NUMBER: _ClassVar[int]
    PROMOTION_BATCHES_FIELD_NUMBER: _ClassVar[int]
    CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOT_ARRIVED_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_WAITS_FIELD_NUMBER: _ClassVar[int]
    ARRIVING_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    url: str
    degraded: bool
    hits: int
    misses: int
    writes: int
    dropped_writes: int
    corrupted: int
    errors: int
    queued_writes: int
    forged: int
    promotion_batches: int
    calls_in_flight: int
    promoted: int
    promoted_bytes: int
    not_arrived: int
    arrival_waits: int
    arriving: int
    seconds: float
    def __init__(self, url: _Optional[str] = ..., degraded: _Optional[bool] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., writes: _Optional[int] = ..., dropped_writes: _Optional[int] = ..., corrupted: _Optional[int] = ..., errors: _Optional[int] = ..., queued_writes: _Optional[int] = ..., forged: _Optional[int] = ..., promotion_batches: _Optional[int] = ..., calls_in_flight: _Optional[int] = ..., promoted: _Optional[int] = ..., promoted_bytes: _Optional[int] = ..., not_arrived: _Optional[int] = ..., arrival_waits: _Optional[int] = ..., arriving: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys", "namespace", "corrupted")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    namespace: bytes
    corrupted: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., namespace: _Optional[bytes] = ..., corrupted: _Optional[bool] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted", "bytes_freed")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    bytes_freed: int
    def __init__(self, deleted: _Optional[int] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("updated", "missing")
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    updated: int
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, updated: _Optional[int] = ..., missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("data_dir", "environment_id", "map_size", "max_bytes", "blob_db_version")
    DATA_DIR_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MAP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOB_DB_VERSION_FIELD_NUMBER: _ClassVar[int]
    data_dir: str
    environment_id: bytes
    map_size: int
    max_bytes: int
    blob_db_version: int
    def __init__(self, data_dir: _Optional[str] = ..., environment_id: _Optional[bytes] = ..., map_size: _Optional[int] = ..., max_bytes: _Optional[int] = ..., blob_db_version: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("incarnation", "from_sequence", "skip_snapshot", "snapshot_page_size")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SKIP_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    from_sequence: int
    skip_snapshot: bool
    snapshot_page_size: int
    def __init__(self, incarnation: _Optional[str] = ..., from_sequence: _Optional[int] = ..., skip_snapshot: _Optional[bool] = ..., snapshot_page_size: _Optional[int] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("sequence", "kind", "tier", "namespace", "prefix_key", "content_key", "num_tokens", "tenant", "parent_key", "unix_time")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    CONTENT_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: KvEventKind
    tier: KvTier
    namespace: bytes
    prefix_key: bytes
    content_key: bytes
    num_tokens: int
    tenant: str
    parent_key: bytes
    unix_time: float
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[KvEventKind, str]] = ..., tier: _Optional[_Union[KvTier, str]] = ..., namespace: _Optional[bytes] = ..., prefix_key: _Optional[bytes] = ..., content_key: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., tenant: _Optional[str] = ..., parent_key: _Optional[bytes] = ..., unix_time: _Optional[float] = ...) -> None: ...

class KvEventsLost(_message.Message):
    __slots__ = ("incarnation", "resume_sequence", "reason")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESUME_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    resume_sequence: int
    reason: str
    def __init__(self, incarnation: _Optional[str] = ..., resume_sequence: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class KvSnapshotEntry(_message.Message):
    __slots__ = ("namespace", "prefix_key", "content_key", "num_tokens", "tenant", "parent_key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    CONTENT_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    prefix_key: bytes
    content_key: bytes
    num_tokens: int
    tenant: str
    parent_key: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., prefix_key: _Optional[bytes] = ..., content_key: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., tenant: _Optional[str] = ..., parent_key: _Optional[bytes] = ...) -> None: ...

class KvSnapshotPage(_message.Message):
    __slots__ = ("entries", "last")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[KvSnapshotEntry]
    last: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[KvSnapshotEntry, _Mapping]]] = ..., last: _Optional[bool] = ...) -> None: ...

class WatchEventsReply(_message.Message):
    __slots__ = ("incarnation", "events", "lost", "snapshot")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    events: KvEventBatch
    lost: KvEventsLost
    snapshot: KvSnapshotPage
    def __init__(self, incarnation: _Optional[str] = ..., events: _Optional[_Union[KvEventBatch, _Mapping]] = ..., lost: _Optional[_Union[KvEventsLost, _Mapping]] = ..., snapshot: _Optional[_Union[KvSnapshotPage, _Mapping]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...
