"""The gateway's gRPC client of the inference service (grpc.aio): token, TLS, deadline on every call."""
from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator, Awaitable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from http_gateway.config import GatewayConfig
from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc

SERVICE_NAME = "kvboost.v1.InferenceService"
CACHE_HEALTH_NAME = "kvboost.v1.CacheService"  # NOT_SERVING while the service runs without its cache daemon
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            # Reconnect soon after the service restarts (gRPC's default backoff grows to two minutes).
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]


class Upstream:
    """One grpc.aio channel to the service; create it inside the running event loop."""

    def __init__(self, config: GatewayConfig) -> None:
        self.address = config.service_addr
        self.timeout_s = config.timeout_s
        if config.tls:
            roots = Path(config.tls_ca).read_bytes() if config.tls_ca else None
            self.channel = grpc.aio.secure_channel(self.address, grpc.ssl_channel_credentials(roots), options=_OPTIONS)
        else:
            self.channel = grpc.aio.insecure_channel(self.address, options=_OPTIONS)
        token = config.service_token()
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, request: pb.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        """Starts a Generate call; read it with `events`, cancel it with `.cancel()`."""
        return self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata)

    async def model_info(self) -> pb.ModelInfoReply:
        return await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout_s, metadata=self.metadata)

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeReply:
        return await self.stub.Tokenize(request, timeout=self.timeout_s, metadata=self.metadata)

    async def detokenize(self, token_ids: list[int]) -> pb.DetokenizeReply:
        return await self.stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids), timeout=self.timeout_s,
                                          metadata=self.metadata)

    async def warm(self, request: pb.WarmRequest) -> pb.WarmResult:
        return await self.stub.Warm(request, timeout=self.timeout_s, metadata=self.metadata)

    async def unpin(self, request: pb.WarmRequest) -> pb.UnpinResult:
        return await self.stub.Unpin(request, timeout=self.timeout_s, metadata=self.metadata)

    async def health_status(self, service: str = SERVICE_NAME, timeout_s: float = 2.0) -> str:
        """SERVING, NOT_SERVING, ... of `service`, or UNREACHABLE."""
        return await status_of(self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s))

    async def close(self) -> None:
        await self.channel.close()


async def status_of(check: Awaitable[health_pb2.HealthCheckResponse]) -> str:
    """The name of a health Check's answer (SERVING, NOT_SERVING, ...), SERVICE_UNKNOWN, or UNREACHABLE."""
    try:
        reply = await check
    except grpc.aio.AioRpcError as error:
        return "SERVICE_UNKNOWN" if error.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def events(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[pb.GenerateEvent]:
    """The call's events; leaving early (an error, a disconnected client) cancels the call, so the model stops."""
    try:
        while (event := await call.read()) is not grpc.aio.EOF:
            yield event
    finally:
        call.cancel()  # no-op once the call has ended
