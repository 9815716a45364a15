"""Scripted in-process replicas behind a real router server, for the router's servicer tests (no model)."""
from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from router.config import ReplicaAddress, RouterConfig
from router.monitor import SERVICE_NAME
from router.replicas import Replica, open_channel
from router.request_keys import RequestKeys
from router.routing import Router
from router.server import build_server

NUM_TOKEN_EVENTS = 3


class FakeReplica(inference_pb2_grpc.InferenceServiceServicer):
    """Records each call (method, request, metadata). Generate streams NUM_TOKEN_EVENTS events, then a result
    whose output_text is the replica's name. fail: every call fails with this status first; fail_after: Generate
    fails UNAVAILABLE after that many events (a replica going away mid-stream)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, Any, dict[str, str]]] = []
        self.fail: grpc.StatusCode | None = None
        self.fail_after: int | None = None
        self.info = pb.ModelInfoReply(model=name, namespace_hex="00" * 32, chunk_size=4, kv_cache_bits=16)
        self.stats = pb.ServiceStatsReply(requests=5, cached_tokens=10, cache_address=name)
        self.health = health.aio.HealthServicer()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(SERVICE_NAME, status)

    def methods(self) -> list[str]:
        return [method for method, _, _ in self.calls]

    async def _enter(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        self.calls.append((method, request, dict(context.invocation_metadata())))
        if self.fail is not None:
            await context.abort(self.fail, f"{self.name} says no")

    async def Generate(self, request, context):
        await self._enter("Generate", request, context)
        for index in range(NUM_TOKEN_EVENTS):
            if self.fail_after == index:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
            yield pb.GenerateEvent(text=f"{self.name}{index} ", token_ids=[index])
        yield pb.GenerateEvent(result=pb.GenerationResult(output_text=self.name, request_id=request.request_id))

    async def GenerateBatch(self, request, context):
        await self._enter("GenerateBatch", request, context)
        return pb.GenerateBatchReply(results=[pb.GenerationResult(output_text=self.name) for _ in request.requests])

    async def GenerateMany(self, request, context):
        await self._enter("GenerateMany", request, context)
        return pb.GenerateBatchReply(results=[pb.GenerationResult(output_text=self.name) for _ in request.requests])

    async def Warm(self, request, context):
        await self._enter("Warm", request, context)
        return pb.WarmResult(token_count=len(request.text), chunks_stored=2)

    async def Unpin(self, request, context):
        await self._enter("Unpin", request, context)
        return pb.UnpinResult(chunks_unpinned=2, token_count=len(request.text))

    async def Stats(self, request, context):
        await self._enter("Stats", request, context)
        return self.stats

    async def ModelInfo(self, request, context):
        await self._enter("ModelInfo", request, context)
        return self.info

    async def Tokenize(self, request, context):
        await self._enter("Tokenize", request, context)
        return pb.TokenizeReply(token_ids=[1, 2])


@asynccontextmanager
async def router_in_front(num_replicas: int = 2, policy: str = "round-robin", keys: RequestKeys | None = None,
                          token_file: Path | None = None,
                          warm: str = "picked") -> AsyncIterator[tuple[Any, list[FakeReplica], Router]]:
    """(router stub, fake replicas, router): replicas and router on free loopback ports, stopped on exit. The
    replicas' health says SERVING; `router.servers[i]` stops replica i (router.replicas[i])."""
    fakes = [FakeReplica(f"fake-{index}") for index in range(num_replicas)]
    servers = []
    replicas = []
    for index, fake in enumerate(fakes):
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(fake, server)
        health_pb2_grpc.add_HealthServicer_to_server(fake.health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await fake.set_serving(True)
        servers.append(server)
        address = ReplicaAddress(f"127.0.0.1:{port}", "127.0.0.1:1")
        replica = Replica(index, address, open_channel(address.service, False, "", 1 << 22))
        replica.healthy = True
        replicas.append(replica)
    router = Router(replicas, policy)
    router.servers = servers
    config = RouterConfig(replicas=tuple(replica.address for replica in replicas), listen="127.0.0.1:0",
                          policy=policy, auth_token_file=str(token_file or ""), warm=warm)
    front = build_server(config, router, keys)
    await front.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{front.port}")
    try:
        yield inference_pb2_grpc.InferenceServiceStub(channel), fakes, router
    finally:
        await channel.close()
        await front.stop(0)
        for replica in replicas:
            await replica.channel.close()
        for server in servers:
            await server.stop(0)
