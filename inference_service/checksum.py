"""CRC-32 with zlib's values: isal's implementation when installed (~3-4x faster), else zlib's."""
try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a pinned dependency; zlib gives identical values
    from zlib import crc32

__all__ = ["crc32"]
