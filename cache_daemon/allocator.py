"""Hands the heap memory the daemon has freed back to the OS (glibc's malloc_trim)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None on another C library (musl, macOS): nothing to trim there."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        logger.info("no glibc malloc_trim here: freed heap memory is left to the C library")
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_heap() -> None:
    """Returns every free page of every malloc arena to the OS (a no-op off glibc).

    Why: each Fetch builds 1 MiB data frames (in Python and again in gRPC's own buffers) on several
    threads. After the first of them is freed glibc raises its mmap threshold above 1 MiB, so later
    frames come from its arenas, one per thread, and when freed stay there: RssAnon climbs by 100+ MiB
    under concurrent Fetches although almost none of it is in use (docs/cache_daemon.md, Memory)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
