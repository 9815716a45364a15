"""A bounded, memory-heavy load beside a test: processes rewriting large buffers (memory bandwidth and CPU),
the kind of busy machine on which a Lookup that moved values ran past the service's deadline."""
from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

# Rewrites its buffer with memset until the deadline (a bound if the test never stops it); says "ready" once.
_REWRITER = """
import ctypes, sys, time
size, until = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
buffer = ctypes.create_string_buffer(size)
value = 1
ctypes.memset(buffer, value, size)
print("ready", flush=True)
while time.monotonic() < until:
    value = (value + 1) & 0xFF
    ctypes.memset(buffer, value, size)
"""


@contextmanager
def memory_heavy_load(num_processes: int = 2, buffer_bytes: int = 256 << 20, max_seconds: float = 240.0
                      ) -> Iterator[list[subprocess.Popen]]:
    """num_processes processes each rewriting a buffer_bytes buffer, running (and first written) when this yields."""
    processes = [subprocess.Popen([sys.executable, "-c", _REWRITER, str(buffer_bytes), str(max_seconds)],
                                  stdout=subprocess.PIPE, text=True) for _ in range(num_processes)]
    try:
        for process in processes:
            assert process.stdout.readline().strip() == "ready", "a load process did not start"
        yield processes
        assert all(process.poll() is None for process in processes), "the load ended before the test did"
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)
            process.stdout.close()
