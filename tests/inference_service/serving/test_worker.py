"""ModelWorker: one thread, bounded queue, updates in order, cancellation and deadlines seen by the job."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from inference_service.serving.worker import DeadlineExceeded, JobCancelled, ModelWorker, QueueFull, WorkerStopped


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=30))


@pytest.fixture()
def worker():
    worker = ModelWorker(max_queue=2)
    yield worker
    worker.stop(timeout_s=5)


def blocking_job(started: threading.Event, release: threading.Event):
    """A job that says it started, then holds the worker until released."""
    def body(job):
        started.set()
        assert release.wait(10), "the test never released the worker"
        return "released"
    return body


def test_jobs_run_on_one_worker_thread_and_return_their_value(worker) -> None:
    async def scenario():
        jobs = [worker.submit(lambda job, n=n: (n * n, threading.current_thread().name)) for n in range(2)]
        return [await job.result() for job in jobs]

    assert run(scenario()) == [(0, "model-worker"), (1, "model-worker")]


def test_updates_arrive_in_order_before_the_result(worker) -> None:
    def body(job):
        for index in range(5):
            job.emit(index)
        return "done"

    async def scenario():
        job = worker.submit(body)
        seen = [update async for update in job.updates()]
        return seen, await job.result()

    assert run(scenario()) == ([0, 1, 2, 3, 4], "done")


def test_an_error_in_the_job_reaches_the_caller(worker) -> None:
    def body(job):
        raise ValueError("bad prompt")

    async def scenario():
        job = worker.submit(body)
        assert [update async for update in job.updates()] == []
        await job.result()

    with pytest.raises(ValueError, match="bad prompt"):
        run(scenario())


def test_a_full_queue_rejects_and_counts(worker) -> None:
    started, release = threading.Event(), threading.Event()

    async def scenario():
        running = worker.submit(blocking_job(started, release))
        await asyncio.to_thread(started.wait, 10)
        # The running job left the queue; two more fill it (max_queue=2), the third is refused.
        queued = [worker.submit(lambda job: "queued") for _ in range(2)]
        assert worker.queue_depth == 2
        with pytest.raises(QueueFull, match="--max-queue"):
            worker.submit(lambda job: "refused")
        release.set()
        return [await running.result()] + [await job.result() for job in queued]

    assert run(scenario()) == ["released", "queued", "queued"]
    assert worker.num_rejected == 1
    assert worker.queue_depth == 0


def test_cancel_is_seen_by_the_running_job(worker) -> None:
    started = threading.Event()

    def body(job):
        before = job.should_stop()
        started.set()
        give_up = time.monotonic() + 10
        while not job.should_stop():
            if time.monotonic() > give_up:
                return before, "never saw the cancel"
            time.sleep(0.001)
        return before, "stopped by the cancel"

    async def scenario():
        job = worker.submit(body)
        await asyncio.to_thread(started.wait, 10)
        job.cancel()
        return await job.result()

    # Running, the job is not asked to stop; after cancel() its next poll is, and it returns its own value.
    assert run(scenario()) == (False, "stopped by the cancel")


def test_a_job_cancelled_while_queued_never_runs(worker) -> None:
    started, release = threading.Event(), threading.Event()
    ran = threading.Event()

    async def scenario():
        blocker = worker.submit(blocking_job(started, release))
        await asyncio.to_thread(started.wait, 10)
        queued = worker.submit(lambda job: ran.set())
        queued.cancel()
        release.set()
        await blocker.result()
        await queued.result()

    with pytest.raises(JobCancelled):
        run(scenario())
    assert not ran.is_set()


class FakeClock:
    """The worker module's clock, moved only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_deadline_stops_a_running_job_and_fails_it(worker, monkeypatch) -> None:
    import inference_service.serving.worker as worker_module

    clock = FakeClock()
    monkeypatch.setattr(worker_module, "time", clock)
    seen = []

    def body(job):
        seen.append(job.should_stop())  # 0.1 s allowed, no time passed
        clock.now += 0.099
        seen.append(job.should_stop())
        clock.now += 0.001  # exactly at the deadline
        seen.append(job.should_stop())
        return "partial"

    async def scenario():
        with pytest.raises(DeadlineExceeded, match="allow it more time"):
            await worker.submit(body, timeout_s=0.1).result()

    run(scenario())
    assert seen == [False, False, True]  # the job saw should_stop() only once its deadline came; its value is dropped


def test_a_job_whose_deadline_passed_while_queued_never_runs(worker) -> None:
    started, release = threading.Event(), threading.Event()
    ran = threading.Event()

    async def scenario():
        blocker = worker.submit(blocking_job(started, release))
        await asyncio.to_thread(started.wait, 10)
        late = worker.submit(lambda job: ran.set(), timeout_s=0.01)
        await asyncio.sleep(0.05)
        release.set()
        await blocker.result()
        await late.result()

    with pytest.raises(DeadlineExceeded):
        run(scenario())
    assert not ran.is_set()


def test_stop_fails_queued_jobs_and_refuses_new_ones() -> None:
    worker = ModelWorker(max_queue=4)
    started, release = threading.Event(), threading.Event()

    async def scenario():
        blocker = worker.submit(blocking_job(started, release))
        await asyncio.to_thread(started.wait, 10)
        queued = worker.submit(lambda job: "never")
        stopping = asyncio.create_task(asyncio.to_thread(worker.stop, 10))
        with pytest.raises(WorkerStopped):
            await queued.result()
        release.set()
        await stopping
        with pytest.raises(WorkerStopped):
            worker.submit(lambda job: "late")
        return await blocker.result()

    # The running job finishes; the queued one and any later one are refused.
    assert run(scenario()) == "released"
