"""One model worker thread fed by a bounded queue; jobs report back to the asyncio servicer that submitted them.

With a scheduler attached (continuous batching) a job may hand its request to the scheduler instead of
running to the end: the thread then takes every queued job, then lets the scheduler run one step, and
so on, so requests join the running batch between decode steps.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DONE = object()  # ends a job's update stream
STREAMING = object()  # a job's run returns this when it handed its request to the scheduler (it finishes later)


class QueueFull(Exception):
    """Every queue slot is taken (RESOURCE_EXHAUSTED)."""


class JobCancelled(Exception):
    """The job was cancelled before the worker started it (CANCELLED)."""


class DeadlineExceeded(Exception):
    """The job's deadline passed before it finished; partial work is dropped (DEADLINE_EXCEEDED)."""


class WorkerStopped(Exception):
    """The service is shutting down and no longer runs jobs (UNAVAILABLE)."""


class ModelNotLoaded(Exception):
    """The service is up but its model is still loading (UNAVAILABLE)."""


class Job(Generic[T]):
    """One unit of model work: runs on the worker thread, is awaited on the event loop.

    The worker-side callable receives the job: it reports partial results with `emit` and polls
    `should_stop` (cancellation or deadline) between steps.
    """

    def __init__(self, run: Callable[[Job[T]], T], loop: asyncio.AbstractEventLoop, timeout_s: float | None, name: str) -> None:
        self.name = name
        self._run = run
        self._loop = loop
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._cancelled = threading.Event()
        self._updates: asyncio.Queue[Any] = asyncio.Queue()
        self._future: asyncio.Future[T] = loop.create_future()

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

    async def result(self) -> T:
        return await asyncio.shield(self._future)

    def execute(self) -> None:
        """Called on the worker thread."""
        if self._cancelled.is_set():
            self.finish(error=JobCancelled(f"{self.name} was cancelled while queued"))
            return
        try:
            value = None if self.deadline_passed() else self._run(self)
        except Exception as error:  # handed to the awaiting coroutine, which maps it to a status
            self.finish(error=error)
            return
        if value is not STREAMING:
            self.settle_from_worker(value, None)

    def settle_from_worker(self, value: T | None, error: BaseException | None) -> None:
        """Called on the worker thread when the job's work ended (a scheduled request calls it itself)."""
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


class Stepper(Protocol):
    """What the worker drives between jobs (engine.scheduler.Scheduler)."""

    num_waiting: int

    def has_work(self) -> bool: ...

    def step(self) -> None: ...

    def fail_waiting(self, error: BaseException) -> None: ...

    def fail_all(self, error: BaseException) -> None: ...


class ModelWorker:
    """Runs jobs on a single thread (the model is not shared across threads), and the scheduler's steps
    between them once one is attached."""

    def __init__(self, max_queue: int) -> None:
        assert max_queue > 0, f"max_queue must be positive, got {max_queue}"
        self.max_queue = max_queue
        self.scheduler: Stepper | None = None  # set once the engine is loaded, in continuous mode
        self.num_rejected = 0
        self.num_completed = 0
        self._queue: queue.Queue[Job[Any] | None] = queue.Queue(maxsize=max_queue)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="model-worker", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for the worker, and requests waiting to join the running batch (running ones not counted)."""
        return self._queue.qsize() + (self.scheduler.num_waiting if self.scheduler is not None else 0)

    def submit(self, run: Callable[[Job[T]], T], timeout_s: float | None = None, name: str = "job") -> Job[T]:
        """Queues `run`; call from the event loop. Raises QueueFull or WorkerStopped."""
        if self._stopped.is_set():
            raise WorkerStopped("the service is shutting down")
        job = Job(run, asyncio.get_running_loop(), timeout_s, name)
        try:
            if self.queue_depth >= self.max_queue:
                raise queue.Full
            self._queue.put_nowait(job)
        except queue.Full:
            self.num_rejected += 1
            raise QueueFull(
                f"{self.max_queue} requests are already waiting for the model; retry later or start the service "
                "with a larger --max-queue"
            ) from None
        return job

    def stop(self, timeout_s: float | None = None) -> None:
        """Fails the jobs still queued, lets the running one finish, and ends the thread."""
        self._stopped.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.finish(error=WorkerStopped("the service shut down before this request started"))
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _serve(self) -> None:
        while True:
            busy = self.scheduler is not None and self.scheduler.has_work()
            try:
                job = self._queue.get_nowait() if busy else self._queue.get()
            except queue.Empty:  # nothing new arrived: one step for the running batch
                self._step()
                continue
            if job is None:
                break
            job.execute()
            self.num_completed += 1
        if self.scheduler is not None:  # shutting down: running requests finish, waiting ones fail
            self.scheduler.fail_waiting(WorkerStopped("the service shut down before this request started"))
            while self.scheduler.has_work():
                self._step()

    def _step(self) -> None:
        try:
            self.scheduler.step()
        except Exception as error:  # a failed step must not end the thread that serves every request
            logger.exception("scheduler step failed; its requests fail")
            self.scheduler.fail_all(error)
