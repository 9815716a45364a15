"""kvboost.v1.InferenceService in front of the replicas: key the request, rank the replicas, forward the call."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

import grpc

from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from kvboost_keys.prompts import PromptPlan
from router import forwarding
from router.forwarding import UpstreamError
from router.request_keys import RequestKeys
from router.routing import Route, Router
from router.stats import sum_stats

# A call's `kvboost-warm: all` (or `picked`) metadata overrides --warm for that Warm.
WARM_METADATA_KEY = "kvboost-warm"


class RouterServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Every RPC goes whole to one replica, except Warm to all (by option), and Unpin and Stats, which ask
    every healthy replica and add up their answers."""

    def __init__(self, router: Router, keys: RequestKeys | None, warm: str = "picked") -> None:
        assert keys is not None or not router.keys_requests, f"the {router.policy} policy needs request keys"
        self.router = router
        self.keys = keys
        self.warm = warm

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateEvent]:
        route = await self._route([request])
        try:
            async for event in forwarding.generate(route.replicas, request, context):
                yield event
        except UpstreamError as error:
            await context.abort(error.code, error.details)

    async def GenerateBatch(self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext) -> pb.GenerateBatchReply:
        return await self._unary("GenerateBatch", request, context, await self._route(request.requests))

    async def GenerateMany(self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext) -> pb.GenerateBatchReply:
        return await self._unary("GenerateMany", request, context, await self._route(request.requests))

    async def Warm(self, request: pb.WarmRequest, context: grpc.aio.ServicerContext) -> pb.WarmResult:
        if _metadata(context, WARM_METADATA_KEY, self.warm) == "all":
            results = await self._everywhere("Warm", request, context)
            return results[0]
        plan = await asyncio.to_thread(self.keys.for_warm, request) if self.router.keys_requests else None
        return await self._unary("Warm", request, context, self.router.route([plan]))

    async def Unpin(self, request: pb.WarmRequest, context: grpc.aio.ServicerContext) -> pb.UnpinResult:
        # A Warm may have pinned on any replica (or on all): every healthy one clears its own pins.
        results = await self._everywhere("Unpin", request, context)
        return pb.UnpinResult(chunks_unpinned=sum(result.chunks_unpinned for result in results),
                              token_count=results[0].token_count)

    async def VerifyCorrectness(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext) -> pb.VerifyReport:
        return await self._unary("VerifyCorrectness", request, context, self.router.route())

    async def Stats(self, request: pb.ServiceStatsRequest, context: grpc.aio.ServicerContext) -> pb.ServiceStatsReply:
        return sum_stats(await self._everywhere("Stats", request, context, all_needed=False))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoReply:
        return await self._unary("ModelInfo", request, context, self.router.route())

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeReply:
        return await self._unary("Tokenize", request, context, self.router.route())

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext) -> pb.DetokenizeReply:
        return await self._unary("Detokenize", request, context, self.router.route())

    async def _route(self, requests: Sequence[pb.GenerateRequest]) -> Route:
        """Keys every request (off the event loop: tokenizing a long prompt takes milliseconds) when the policy
        reads keys; a batch is ranked by the reuse of all its requests together."""
        plans: list[PromptPlan | None] = []
        if self.router.keys_requests:
            plans = await asyncio.to_thread(lambda: [self.keys.for_generate(item) for item in requests])
        mode = requests[0].mode if len(requests) else pb.MODE_UNSPECIFIED
        return self.router.route(plans, mode)

    async def _unary(self, method: str, request: Any, context: grpc.aio.ServicerContext, route: Route) -> Any:
        try:
            return await forwarding.unary(route.replicas, method, request, context)
        except UpstreamError as error:
            await context.abort(error.code, error.details)

    async def _everywhere(self, method: str, request: Any, context: grpc.aio.ServicerContext,
                          all_needed: bool = True) -> list[Any]:
        """Every healthy replica's reply to the same call. all_needed: any failure is the caller's status (a
        pin left behind matters); else the replies that came, failing only when none did (Stats)."""
        replicas = [replica for replica in self.router.replicas if replica.healthy] or self.router.replicas
        outcomes = await asyncio.gather(*(forwarding.unary([replica], method, request, context)
                                          for replica in replicas), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, UpstreamError):
                raise outcome
        replies = [outcome for outcome in outcomes if not isinstance(outcome, UpstreamError)]
        failures = [outcome for outcome in outcomes if isinstance(outcome, UpstreamError)]
        if failures and (all_needed or not replies):
            await context.abort(failures[0].code, failures[0].details)
        return replies


def _metadata(context: grpc.aio.ServicerContext, key: str, default: str) -> str:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return str(value)
    return default
