"""The blob checksum: CRC-32 as zlib computes it, through ISA-L's SIMD version when installed (daemon and service)."""
from __future__ import annotations

try:
    # Same polynomial and values as zlib.crc32, about 4x faster where the CPU has carry-less
    # multiply (PCLMULQDQ); Fetch checks every blob it serves, so this is on the hot path.
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32

__all__ = ["crc32"]
