"""What every endpoint shares: configuration, the gRPC client, metrics, and the served model's identity."""
from __future__ import annotations

import time
from typing import Awaitable, TypeVar

import grpc
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from http_gateway.auth import Caller, Keys
from http_gateway.config import GatewayConfig
from http_gateway.errors import (
    GatewayError, from_rpc_error, from_validation_error, invalid_request, model_not_found, permission_denied,
)
from http_gateway.metrics import GatewayMetrics
from http_gateway.upstream import Upstream
from kvboost.v1 import inference_pb2 as pb

T = TypeVar("T")


class Gateway:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics, keys: Keys | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.keys = keys or Keys()
        self.started = int(time.time())
        self.upstream: Upstream | None = None  # opened in the app's lifespan, on its event loop
        self._model_info: pb.ModelInfoReply | None = None

    async def model_info(self) -> pb.ModelInfoReply:
        """The service's ModelInfo, asked once (the service may start after the gateway)."""
        if self._model_info is None:
            self._model_info = await self.call(self.upstream.model_info())
        return self._model_info

    async def served_model(self, requested: str | None = None) -> str:
        """The model id responses carry; raises 404 model_not_found when `requested` names another model."""
        info = await self.model_info()
        served = self.config.served_model_name or info.model
        if requested and requested not in (served, info.model):
            raise model_not_found(requested)
        return served

    def cache_salt(self, request: Request, client_salt: str | None, tenant: str | None = None) -> str:
        """The request's cache scope: its caller's tenant (with the client's salt inside it), or with an admin
        key the named `tenant`'s."""
        caller: Caller = request.state.caller
        if tenant is not None:
            if not caller.admin:
                raise permission_denied("only an admin key may act in another tenant's cache scope", "tenant")
            if not self.keys.knows_tenant(tenant):
                raise invalid_request(f"no tenant {tenant!r} in the gateway's --keys-file", "tenant")
        return caller.cache_salt(client_salt, tenant)

    def rpc_error(self, error: grpc.RpcError) -> GatewayError:
        return from_rpc_error(error, self.config.retry_after_s)

    async def call(self, rpc: Awaitable[T]) -> T:
        """Awaits one unary call to the service; its gRPC status becomes the HTTP error an OpenAI client expects."""
        try:
            return await rpc
        except grpc.aio.AioRpcError as error:
            raise self.rpc_error(error) from None


async def parse_body(request: Request, schema: type[BaseModel]) -> BaseModel:
    """The JSON body as `schema`; 400 (never 422) naming what is wrong."""
    raw = await request.body()
    if not raw.strip():
        raise invalid_request("the request body is empty; send a JSON object")
    try:
        return schema.model_validate_json(raw)
    except ValidationError as error:
        raise from_validation_error(error) from None
