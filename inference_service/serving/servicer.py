"""kvboost.v1.InferenceService on grpc.aio: parse the request, run the engine on the model worker, build the reply."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

import grpc

from inference_service.serving import proto_convert as convert
from inference_service.errors import InvalidRequest
from inference_service.serving.error_status import abort_with
from inference_service.engine.scheduler import StreamRequest
from inference_service.serving.worker import STREAMING, Job, ModelNotLoaded, ModelWorker
from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Every method that touches the model runs it on the single worker thread; the loop only waits."""

    def __init__(self, worker: ModelWorker, cache_address: str, engine: Any = None) -> None:
        self.worker = worker
        self.cache_address = cache_address
        self.engine = engine  # set once the model is loaded; until then calls are UNAVAILABLE

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateEvent]:
        arrival = time.perf_counter()
        try:
            params = convert.generation_params(request, arrival)
            if self.worker.scheduler is not None:  # joins the running batch (n completions as n rows)
                job = self._submit(context, params.request_id, lambda job: self._schedule(job, lambda on_done: [
                    StreamRequest(params, on_token=lambda event: job.emit(convert.token_event(event)),
                                  should_stop=job.should_stop, on_done=on_done)]))
            else:
                job = self._submit(context, params.request_id, lambda job: self._engine().generate_choices(
                    params, on_token=lambda event: job.emit(convert.token_event(event)), should_stop=job.should_stop))
        except Exception as error:
            await abort_with(context, error, request.request_id)
        try:
            async for event in job.updates():
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
        """The call's requests join the running batch (its shared prefix prefilled once); without a scheduler
        the whole call is one job on the model worker."""
        arrival = time.perf_counter()
        try:
            batch = convert.batch_params(request, arrival)
            if not batch:
                raise InvalidRequest(f"{name} needs at least one request in `requests`")
            if self.worker.scheduler is not None:
                run = lambda job: self._schedule(job, lambda on_done: self._engine().batch_requests(
                    batch, by_first_chunk, job.should_stop, on_done))
            else:
                method = self._engine().generate_many if by_first_chunk else self._engine().generate_batch
                run = lambda job: method(batch, should_stop=job.should_stop)
            outcomes = await self._run(context, name, run)
        except Exception as error:
            await abort_with(context, error, name)
        return pb.GenerateBatchReply(results=[convert.generation_result(outcome) for outcome in outcomes])

    async def Warm(self, request: pb.WarmRequest, context: grpc.aio.ServicerContext) -> pb.WarmResult:
        try:
            arguments = convert.warm_arguments(request)
            outcome = await self._run(context, "warm", lambda job: self._engine().warm(**arguments))
        except Exception as error:
            await abort_with(context, error, "warm")
        return convert.warm_result(outcome)

    async def VerifyCorrectness(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext) -> pb.VerifyReport:
        try:
            arguments = convert.verify_arguments(request)
            rows = await self._run(context, "verify", lambda job: self._engine().verify(**arguments))
        except Exception as error:
            await abort_with(context, error, "verify")
        return convert.verify_report(rows)

    async def Stats(self, request: pb.ServiceStatsRequest, context: grpc.aio.ServicerContext) -> pb.ServiceStatsReply:
        engine_stats = self.engine.stats() if self.engine is not None else {}  # counters and `degraded`
        return convert.stats_reply(
            engine_stats,
            rejected=self.worker.num_rejected,
            cache_address=self.cache_address,
            queue_depth=self.worker.queue_depth,
        )

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoReply:
        try:
            return convert.model_info_reply(self._engine().model_info())
        except Exception as error:
            await abort_with(context, error, "model-info")

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeReply:
        # Off the model worker: counting tokens never waits behind generation (fast tokenizers are thread-safe).
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

    def _schedule(self, job: Job[Any], requests_for: Callable[[Callable[..., None]], list[StreamRequest]]) -> object:
        """On the worker thread: hands the requests to the scheduler; the job ends when they report through on_done."""
        for stream_request in requests_for(job.settle_from_worker):
            self.worker.scheduler.submit(stream_request)
        return STREAMING

    def _engine(self) -> Any:
        if self.engine is None:
            raise ModelNotLoaded("the model is still loading")
        return self.engine

    def _submit(self, context: grpc.aio.ServicerContext, name: str, run: Callable[[Job[Any]], Any]) -> Job[Any]:
        self._engine()  # fail fast, before queueing, while the model loads
        return self.worker.submit(run, timeout_s=context.time_remaining(), name=name)

    async def _run(self, context: grpc.aio.ServicerContext, name: str, run: Callable[[Job[Any]], Any]) -> Any:
        job = self._submit(context, name, run)
        try:
            return await job.result()
        finally:
            job.cancel()
