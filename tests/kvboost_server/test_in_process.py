"""The in-process transport's streamed call: a reader that is cancelled (the HTTP client left) always cancels the
servicer's generator, even when the cancellation arrives just as an event is ready; a deadline ends the call with
DEADLINE_EXCEEDED, even when events are ready; cancel() between reads closes the generator, and during a read in
another task cancels that read."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from kvboost_server.in_process import InProcessCall, InProcessError


def servicer_events(gate: asyncio.Future, closed: list[str]):
    """Stands in for InferenceServicer.Generate: its `finally` is where the job is cancelled."""
    async def events():
        try:
            await gate
            yield "first"
            await asyncio.Event().wait()  # the model never produces a second event
            yield "second"
        finally:
            closed.append("job cancelled")
    return events()


async def until_closed(closed: list[str], turns: int = 100) -> None:
    """Lets the event loop run until the generator's finally ran (the close is a task of its own), at most `turns`."""
    for _ in range(turns):
        if closed:
            return
        await asyncio.sleep(0)


def test_a_reader_cancelled_as_its_event_is_ready_cancels_the_generator():
    # asyncio.wait_for before Python 3.12 returned the ready event here and dropped the cancellation, so the
    # request ran to its end after its client had gone (seen 1 in 3-8 tries through `python -m kvboost_server`).
    async def scenario():
        gate, closed = asyncio.get_running_loop().create_future(), []
        call = InProcessCall(servicer_events(gate, closed), timeout_s=60)
        reader = asyncio.ensure_future(call.read())
        await asyncio.sleep(0)  # the reader waits for the model
        gate.set_result(None)  # the event is ready ...
        reader.cancel()  # ... as the client leaves
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert closed == ["job cancelled"]
        assert await call.read() is grpc.aio.EOF and not call.cancel()

    asyncio.run(scenario())


def test_a_deadline_ends_the_call_and_cancels_the_generator():
    async def scenario():
        gate, closed = asyncio.get_running_loop().create_future(), []
        call = InProcessCall(servicer_events(gate, closed), timeout_s=0.05)
        with pytest.raises(InProcessError) as raised:
            await call.read()
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert closed == ["job cancelled"]
        assert await call.read() is grpc.aio.EOF

    asyncio.run(scenario())


def test_cancel_between_reads_closes_the_generator():
    async def scenario():
        gate, closed = asyncio.get_running_loop().create_future(), []
        gate.set_result(None)
        call = InProcessCall(servicer_events(gate, closed), timeout_s=60)
        assert await call.read() == "first"
        assert call.cancel()
        await until_closed(closed)
        assert closed == ["job cancelled"]
        assert await call.read() is grpc.aio.EOF

    asyncio.run(scenario())


def test_a_passed_deadline_ends_the_call_even_with_an_event_ready():
    async def scenario():
        gate, closed = asyncio.get_running_loop().create_future(), []
        gate.set_result(None)
        call = InProcessCall(servicer_events(gate, closed), timeout_s=0.05)
        assert await call.read() == "first"  # the job is on the engine (a generator not started holds none)
        await asyncio.sleep(0.1)  # the deadline itself passes: time is the condition here
        with pytest.raises(InProcessError) as raised:
            await call.read()
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until_closed(closed)
        assert closed == ["job cancelled"]

    asyncio.run(scenario())


def test_cancel_during_a_read_in_another_task_cancels_that_read_and_the_generator():
    async def scenario():
        gate, closed = asyncio.get_running_loop().create_future(), []
        call = InProcessCall(servicer_events(gate, closed), timeout_s=60)
        reader = asyncio.ensure_future(call.read())
        await asyncio.sleep(0)  # the reader waits for the model
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert closed == ["job cancelled"]

    asyncio.run(scenario())
