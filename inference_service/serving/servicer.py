"""kvboost.v1.InferenceService on grpc.aio: parse the request, submit it to the engine, build the reply."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

import grpc

from inference_service.engine.engine import Engine
from inference_service.errors import InvalidRequest, QueueFull
from inference_service.serving import proto_convert as convert
from inference_service.serving.error_status import abort_with
from inference_service.serving.jobs import Job, ModelNotLoaded
from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Requests go to the engine's step loop through Engine.submit*; the event loop only waits on their Job."""

    def __init__(self, cache_address: str, engine: Engine | None = None) -> None:
        self.cache_address = cache_address
        self.engine = engine  # set once the model is loaded; until then calls are UNAVAILABLE
        self.num_rejected = 0  # requests refused because the engine's queue was full

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateEvent]:
        arrival = time.perf_counter()
        try:
            params = convert.generation_params(request, arrival)
            job = await self._submit(context, params.request_id, lambda engine, job: engine.submit(
                params, lambda event: job.emit(convert.token_event(event)), job.should_stop, job.on_done))
        except Exception as error:
            await abort_with(context, error, request.request_id)
        try:
            async for batch in job.update_batches():
                for event in coalesce(batch):
                    yield event
            outcomes = await job.result()
        except Exception as error:
            await abort_with(context, error, params.request_id)
        finally:
            job.cancel()  # the client went away or the deadline passed: the engine stops at its next step
        for outcome in outcomes:
            yield convert.final_event(outcome)

    async def GenerateBatch(self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext) -> pb.GenerateBatchReply:
        return await self._batch(request, context, "GenerateBatch", by_first_chunk=False)

    async def GenerateMany(self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext) -> pb.GenerateBatchReply:
        return await self._batch(request, context, "GenerateMany", by_first_chunk=True)

    async def _batch(self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext, name: str,
                     by_first_chunk: bool) -> pb.GenerateBatchReply:
        """The call's requests run on the step loop beside every other request (its shared prefix prefilled once)."""
        arrival = time.perf_counter()
        try:
            batch = convert.batch_params(request, arrival)
            if not batch:
                raise InvalidRequest(f"{name} needs at least one request in `requests`")
            outcomes = await self._run(context, name, lambda engine, job: engine.submit_batch(
                batch, by_first_chunk, job.should_stop, job.on_done))
        except Exception as error:
            await abort_with(context, error, name)
        return pb.GenerateBatchReply(results=[convert.generation_result(outcome) for outcome in outcomes])

    async def Warm(self, request: pb.WarmRequest, context: grpc.aio.ServicerContext) -> pb.WarmResult:
        try:
            arguments = convert.warm_arguments(request)
            outcome = await self._run(context, "warm", lambda engine, job: engine.submit_warm(
                job.on_done, should_stop=job.should_stop, **arguments))
        except Exception as error:
            await abort_with(context, error, "warm")
        return convert.warm_result(outcome)

    async def Unpin(self, request: pb.WarmRequest, context: grpc.aio.ServicerContext) -> pb.UnpinResult:
        try:
            arguments = convert.warm_arguments(request)
            del arguments["pin"]
            unpinned, token_count = await asyncio.to_thread(self._engine().unpin, **arguments)  # no model run
        except Exception as error:
            await abort_with(context, error, "unpin")
        return pb.UnpinResult(chunks_unpinned=unpinned, token_count=token_count)

    async def VerifyCorrectness(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext) -> pb.VerifyReport:
        try:
            arguments = convert.verify_arguments(request)
            rows = await asyncio.to_thread(self._engine().verify, **arguments)  # submits its runs and waits
        except Exception as error:
            await abort_with(context, error, "verify")
        return convert.verify_report(rows)

    async def Stats(self, request: pb.ServiceStatsRequest, context: grpc.aio.ServicerContext) -> pb.ServiceStatsReply:
        engine_stats = self.engine.stats() if self.engine is not None else {}  # counters, scheduler, `degraded`
        return convert.stats_reply(
            engine_stats,
            rejected=self.num_rejected,
            cache_address=self.cache_address,
            queue_depth=engine_stats.get("waiting_requests", 0),
        )

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoReply:
        try:
            return convert.model_info_reply(self._engine().model_info())
        except Exception as error:
            await abort_with(context, error, "model-info")

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeReply:
        # Off the step loop: counting tokens never waits behind generation (fast tokenizers are thread-safe).
        try:
            engine = self._engine()
            token_ids, tokens = await asyncio.to_thread(engine.tokenize, **convert.tokenize_arguments(request))
        except Exception as error:
            await abort_with(context, error, "tokenize")
        return convert.tokenize_reply(token_ids, tokens, engine.geometry.max_context)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext) -> pb.DetokenizeReply:
        try:
            text = await asyncio.to_thread(self._engine().detokenize, list(request.token_ids))
        except Exception as error:
            await abort_with(context, error, "detokenize")
        return pb.DetokenizeReply(text=text)

    def _engine(self) -> Engine:
        if self.engine is None:
            raise ModelNotLoaded("the model is still loading")
        return self.engine

    async def _submit(self, context: grpc.aio.ServicerContext, name: str,
                      submit: Callable[[Engine, Job[Any]], None]) -> Job[Any]:
        """A Job for the request, handed to the engine by submit(engine, job); raises what the engine refuses.

        submit tokenizes, templates and hashes the prompt (milliseconds for a long one): on a worker thread, so the
        event loop keeps streaming other requests' tokens meanwhile and the step loop never does it.
        """
        engine = self._engine()
        job: Job[Any] = Job(asyncio.get_running_loop(), context.time_remaining(), name)
        try:
            await asyncio.to_thread(submit, engine, job)
        except asyncio.CancelledError:
            job.cancel()  # the caller went away while the prompt was planned: the engine drops it at its next step
            raise
        except Exception as error:
            if isinstance(error, QueueFull):
                self.num_rejected += 1
            raise
        return job

    async def _run(self, context: grpc.aio.ServicerContext, name: str,
                   submit: Callable[[Engine, Job[Any]], None]) -> Any:
        job = await self._submit(context, name, submit)
        try:
            return await job.result()
        finally:
            job.cancel()


def coalesce(events: list[pb.GenerateEvent]) -> list[pb.GenerateEvent]:
    """Merges consecutive token events of the same completion into one message (text, token ids and logprobs
    appended in order), so a reader that fell behind gets what accumulated in few messages, nothing lost."""
    merged: list[pb.GenerateEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if last is None or last.index != event.index or event.HasField("result") or last.HasField("result") \
                or len(event.prompt_logprobs):
            merged.append(event)
            continue
        last.text += event.text
        last.token_ids.extend(event.token_ids)
        last.logprobs.extend(event.logprobs)
    return merged
