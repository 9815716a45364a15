"""A Job: one request handed to the engine, awaited on the event loop; the engine reports back from its thread."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DONE = object()  # ends a job's update stream


class JobCancelled(Exception):
    """The job was cancelled before the worker started it (CANCELLED)."""


class DeadlineExceeded(Exception):
    """The job's deadline passed before it finished; partial work is dropped (DEADLINE_EXCEEDED)."""


class ModelNotLoaded(Exception):
    """The service is up but its model is still loading (UNAVAILABLE)."""


class Job(Generic[T]):
    """One request's link between the event loop and the engine's thread: the engine streams with `emit`, polls
    `should_stop` (cancellation or deadline) every step and ends it with `on_done`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float | None, name: str) -> None:
        self.name = name
        self._loop = loop
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._cancelled = threading.Event()
        self._updates: asyncio.Queue[Any] = asyncio.Queue()
        self._future: asyncio.Future[T] = loop.create_future()
        # A reader that went away (a closed stream, a cancelled call) never awaits result(): the outcome it would
        # have read (a deadline, a failure) is looked at here, so asyncio does not log it as never retrieved.
        self._future.add_done_callback(lambda future: future.cancelled() or future.exception())

    def cancel(self) -> None:
        self._cancelled.set()

    def should_stop(self) -> bool:
        return self._cancelled.is_set() or self.deadline_passed()

    def deadline_passed(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def emit(self, update: Any) -> None:
        """Called on the worker thread: hands one update to the event loop."""
        self._call_in_loop(self._updates.put_nowait, update)

    async def updates(self) -> AsyncIterator[Any]:
        """Everything emitted, in order, until the job ends; then `await result()`."""
        while (update := await self._updates.get()) is not _DONE:
            yield update

    async def update_batches(self) -> AsyncIterator[list[Any]]:
        """Like `updates`, but each step hands over everything queued by then, in order: one update while the
        reader keeps up, several once it falls behind (a slow stream writer)."""
        while (update := await self._updates.get()) is not _DONE:
            batch = [update]
            while not self._updates.empty():
                update = self._updates.get_nowait()
                if update is _DONE:
                    yield batch
                    return
                batch.append(update)
            yield batch

    async def result(self) -> T:
        return await asyncio.shield(self._future)

    def on_done(self, value: T | None, error: BaseException | None) -> None:
        """Called once on the engine's thread when the request ended."""
        if error is not None:
            self.finish(error=error)
        elif self.deadline_passed():
            self.finish(error=DeadlineExceeded(f"{self.name} did not finish before its deadline; allow it more time"))
        else:
            self.finish(value=value)

    def finish(self, value: T | None = None, error: BaseException | None = None) -> None:
        self._call_in_loop(self._settle, value, error)

    def _settle(self, value: T | None, error: BaseException | None) -> None:
        if not self._future.done():
            if error is None:
                self._future.set_result(value)  # type: ignore[arg-type]
            else:
                self._future.set_exception(error)
        self._updates.put_nowait(_DONE)

    def _call_in_loop(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody awaits this job any more
            logger.debug("%s finished after its event loop closed", self.name)
