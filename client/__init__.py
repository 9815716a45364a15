"""KVBoost client: the Python library, the `kvboost` CLI, the local stack runner."""
from client.cache_client import DEFAULT_DAEMON_ADDRESS, CacheClient
from client.errors import (
    AuthenticationError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVBoostError,
    NotFoundError,
    OverloadedError,
    UnavailableError,
)
from client.library import DEFAULT_ADDRESS, GenerationStream, KVBoostClient
from client.results import (
    CacheStats,
    DeleteResult,
    GenerationResult,
    ModelInfo,
    PinResult,
    ServiceStats,
    VerifyReport,
    WarmResult,
)

__all__ = [
    "DEFAULT_ADDRESS", "DEFAULT_DAEMON_ADDRESS", "KVBoostClient", "CacheClient", "GenerationStream",
    "KVBoostError", "InvalidArgumentError", "NotFoundError", "UnavailableError", "DeadlineExceededError",
    "OverloadedError", "AuthenticationError", "CancelledError", "FailedPreconditionError",
    "GenerationResult", "WarmResult", "VerifyReport", "ServiceStats", "ModelInfo", "CacheStats",
    "DeleteResult", "PinResult",
]
