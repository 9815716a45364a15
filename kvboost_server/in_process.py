"""The gateway's upstream over the inference servicer in the same process: the calls the gateway makes over gRPC
(Generate streamed, ModelInfo, Tokenize, Detokenize, Warm, Unpin, health), with the same messages, statuses and
deadlines, and no channel, HTTP/2 framing or second process in between."""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

if sys.version_info >= (3, 11):
    from asyncio import timeout_at
else:  # the stdlib's asyncio.timeout_at, backported by aio-libs
    from async_timeout import timeout_at

from http_gateway.upstream import SERVICE_NAME, status_of
from kvboost.v1 import inference_pb2 as pb


class InProcessError(grpc.aio.AioRpcError):
    """What the servicer aborted with, as the gateway would receive it from a channel."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Context:
    """The part of grpc.aio.ServicerContext the servicer uses: its deadline, and abort."""

    def __init__(self, timeout_s: float | None) -> None:
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "", *args: Any) -> None:
        raise InProcessError(code, details)


class InProcessCall:
    """A streamed Generate: read() gives the next event or grpc.aio.EOF; cancel() stops the request at the engine's
    next step, as a cancelled gRPC call does.

    Each read awaits the servicer's generator in the reader's own task, under a timeout that cancels only that
    await. (Not asyncio.wait_for: before Python 3.12 it runs the read in a task of its own and, when the reader is
    cancelled just as that task finishes, returns the event and drops the cancellation. A client that left then
    went unnoticed and its request ran to its last token.) A reader that is cancelled cancels the servicer's
    generator with it, whose `finally` cancels the job."""

    def __init__(self, events: AsyncIterator[pb.GenerateEvent], timeout_s: float | None) -> None:
        self._events = events
        self._loop = asyncio.get_running_loop()
        self._deadline = None if timeout_s is None else self._loop.time() + timeout_s
        self._done = False
        self._closing: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None  # the task inside read(), while it is there

    async def read(self):
        if self._done:
            return grpc.aio.EOF
        if self._deadline is not None and self._loop.time() >= self._deadline:  # even if an event is ready
            self.cancel()
            raise InProcessError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        self._reader = asyncio.current_task()
        try:
            async with timeout_at(self._deadline):
                return await self._events.__anext__()
        except StopAsyncIteration:
            self._done = True
            return grpc.aio.EOF
        except asyncio.TimeoutError:  # the generator saw the cancellation: its job is cancelled
            self._done = True
            raise InProcessError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except BaseException:
            self._done = True  # cancelled, or the servicer aborted: the generator is finished either way
            raise
        finally:
            self._reader = None

    def cancel(self) -> bool:
        if self._done:
            return False
        self._done = True
        if self._reader is not None and self._reader is not asyncio.current_task():
            # A read is under way in another task: cancelling it cancels the generator where it waits (a cancelled
            # gRPC call's pending read raises CancelledError too).
            self._reader.cancel()
        else:  # between reads the generator is suspended at a yield: closing it runs the servicer's finally
            # Held, so the loop cannot drop the task before the generator is closed.
            self._closing = asyncio.ensure_future(self._events.aclose())
        return True


class InProcessUpstream:
    """http_gateway.upstream.Upstream's interface over an InferenceServicer and the service's health servicer."""

    address = "in-process"

    def __init__(self, servicer: Any, health: Any, timeout_s: float) -> None:
        self.servicer, self.health, self.timeout_s = servicer, health, timeout_s

    def generate(self, request: pb.GenerateRequest) -> InProcessCall:
        context = Context(self.timeout_s)
        return InProcessCall(self.servicer.Generate(request, context), self.timeout_s)

    async def _unary(self, method, request):
        context = Context(self.timeout_s)
        try:
            async with timeout_at(asyncio.get_running_loop().time() + self.timeout_s):
                return await method(request, context)
        except asyncio.TimeoutError:
            raise InProcessError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    async def model_info(self) -> pb.ModelInfoReply:
        return await self._unary(self.servicer.ModelInfo, pb.ModelInfoRequest())

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeReply:
        return await self._unary(self.servicer.Tokenize, request)

    async def detokenize(self, token_ids: list[int]) -> pb.DetokenizeReply:
        return await self._unary(self.servicer.Detokenize, pb.DetokenizeRequest(token_ids=token_ids))

    async def warm(self, request: pb.WarmRequest) -> pb.WarmResult:
        return await self._unary(self.servicer.Warm, request)

    async def unpin(self, request: pb.WarmRequest) -> pb.UnpinResult:
        return await self._unary(self.servicer.Unpin, request)

    async def health_status(self, service: str = SERVICE_NAME, timeout_s: float = 2.0) -> str:
        return await status_of(self.health.Check(health_pb2.HealthCheckRequest(service=service), Context(timeout_s)))

    async def close(self) -> None:
        pass
