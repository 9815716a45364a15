"""Which threads of the service run torch's CPU ops on an OpenMP team: the step loop's only."""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def confine_to_this_thread() -> None:
    """Makes the calling helper thread run torch's CPU ops on itself alone, without an OpenMP team of its own.

    Why (docs/performance.md, One OpenMP team): libgomp spins between parallel regions only while the threads it
    manages are no more than the CPUs; a second thread with a team of its own (the write-back encoder's) puts it
    over on two cores, and from then on each of the step loop's parallel regions waits on a sleeping worker, which
    halved one stream's rate. Only the step loop should own a team. Nothing happens where torch's
    parallel backend is not OpenMP or libgomp cannot be found.
    """
    global _omp_set_num_threads
    if _omp_set_num_threads is None:
        _omp_set_num_threads = _find_omp_set_num_threads() or (lambda count: None)
    torch.get_num_threads()  # ATen's per-thread setup first: it would later reset this thread's count to torch's
    _omp_set_num_threads(1)


_omp_set_num_threads = None


def _find_omp_set_num_threads():
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    for name in (str(bundled), "libgomp.so.1"):
        try:
            function = ctypes.CDLL(name).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], None
        return function
    logger.info("libgomp not found: helper threads keep torch's intra-op thread count")
    return None


def lower_this_threads_priority(by: int = 10) -> None:
    """Makes the calling background thread (a write-back's encoder) yield the CPU to the step loop: on Linux a thread
    has a nice value of its own, raised here by `by` (raising needs no privilege). Elsewhere nothing happens."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except OSError:  # not allowed here (a sandbox): the thread keeps its priority
        pass
