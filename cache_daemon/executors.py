"""The daemon's thread pools, one per kind of blocking work, so a slow Redis cannot starve Fetch."""
from __future__ import annotations

import asyncio
import contextvars
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

_DEFAULT_THREADS = min(32, (os.cpu_count() or 1) + 4)  # what asyncio's default executor would have


class DaemonExecutors:
    """fetch: LMDB reads for Fetch (never waits on the network). l2: Lookups that ask Redis. store: LMDB
    writes, sync L2 writes and deletes. Each pool has its own threads: a Redis that stops answering ties
    up `l2` (and sync `store`) threads for --l2-timeout, while Fetch of what LMDB holds goes on."""

    def __init__(self, num_threads: int = _DEFAULT_THREADS) -> None:
        self.fetch = ThreadPoolExecutor(num_threads, thread_name_prefix="fetch")
        self.l2 = ThreadPoolExecutor(num_threads, thread_name_prefix="l2-lookup")
        self.store = ThreadPoolExecutor(num_threads, thread_name_prefix="store")

    @staticmethod
    def run(executor: ThreadPoolExecutor, function: Callable[..., T], *args) -> asyncio.Future:
        """function(*args) in executor, with this task's context (request id, tenant) as asyncio.to_thread does."""
        context = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(executor, context.run, function, *args)

    def shutdown(self) -> None:
        for executor in (self.fetch, self.l2, self.store):
            executor.shutdown(wait=True, cancel_futures=True)
