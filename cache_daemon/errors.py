"""Domain errors of the cache daemon and the one table that maps them to gRPC status codes."""
from __future__ import annotations

import grpc


class CacheError(Exception):
    """A request the cache cannot serve; the message is sent to the client as the status detail."""


class InvalidCacheRequest(CacheError):
    """Malformed input: bad key length, frames out of order, oversized frame, checksum mismatch."""


class NotFound(CacheError):
    """Nothing to act on: an unknown namespace in Delete, no known key in Pin/Unpin."""


class PermissionDenied(CacheError):
    """The caller's token is valid but its role may not do this (Describe by a tenant)."""


class BudgetExceeded(CacheError):
    """The blob cannot fit inside --max-bytes, not even after evicting every unpinned chunk."""


class StoreStreamOverLimit(CacheError):
    """A Store stream beyond --max-store-chunks or --max-store-bytes, or still open at --store-deadline."""


class DiskFull(CacheError):
    """LMDB could not write a transaction and the disk under --data-dir has no room for it; nothing of that
    transaction was written, what was stored before is intact."""


class WriteFailed(CacheError):
    """LMDB refused a write for another reason (an I/O error); nothing of that transaction was written."""


class L2NotAcknowledged(CacheError):
    """--l2-write sync: the shared tier did not take the chunks in time (they are in this host's LMDB)."""


class StartupError(Exception):
    """The daemon cannot start: port taken, data dir owned by another daemon, unreadable files."""


_STATUS_BY_ERROR: dict[type[CacheError], grpc.StatusCode] = {
    InvalidCacheRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    BudgetExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StoreStreamOverLimit: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DiskFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WriteFailed: grpc.StatusCode.INTERNAL,
    L2NotAcknowledged: grpc.StatusCode.UNAVAILABLE,
}


def status_code_for(error: CacheError) -> grpc.StatusCode:
    for error_type, code in _STATUS_BY_ERROR.items():
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def check_blob_fits(key: bytes, size_bytes: int, max_bytes: int) -> None:
    if size_bytes > max_bytes:
        raise BudgetExceeded(f"chunk {key.hex()[:16]} has {size_bytes} bytes, more than the whole budget "
                             f"--max-bytes={max_bytes}")
