"""The daemon's CRC-32 is zlib's, whichever implementation serves it."""
from __future__ import annotations

import random
import zlib

from kvboost_common.checksum import crc32


def test_crc32_matches_zlib_whole_and_incremental() -> None:
    blob = random.Random(0).randbytes(3_000_001)
    assert crc32(blob) == zlib.crc32(blob)
    assert crc32(memoryview(blob)[1000:], crc32(blob[:1000])) == zlib.crc32(blob)
    assert crc32(b"") == 0
