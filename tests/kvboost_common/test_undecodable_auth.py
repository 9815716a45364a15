"""The inference service with a bearer token: an undecodable request without the token is refused as
unauthenticated (the token check runs first), with it INVALID_ARGUMENT; health stays open and guarded."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from inference_service.serving.config import ServiceConfig
from inference_service.serving.server import build_server

BAD_UTF8_PROMPT = b"\x0a\x02\xff\xfe"  # GenerateRequest.prompt (field 1) holding invalid UTF-8
GENERATE = "/kvboost.v1.InferenceService/Generate"
STATS = "/kvboost.v1.InferenceService/Stats"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


@pytest.mark.parametrize("method, streaming, with_token, expected", [
    (GENERATE, True, False, grpc.StatusCode.UNAUTHENTICATED),
    (GENERATE, True, True, grpc.StatusCode.INVALID_ARGUMENT),
    (STATS, False, False, grpc.StatusCode.UNAUTHENTICATED),
    (HEALTH_CHECK, False, False, grpc.StatusCode.INVALID_ARGUMENT),  # open for probes, still parsed strictly
])
def test_the_token_is_checked_before_the_request_is_parsed(tmp_path, method, streaming, with_token, expected):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config = ServiceConfig(listen="127.0.0.1:0", auth_token_file=str(token_file))
    metadata = [("authorization", "Bearer s3cret")] if with_token else []
    wire = BAD_UTF8_PROMPT if method != HEALTH_CHECK else b"\x0a\x01\xff"  # HealthCheckRequest.service

    async def scenario():
        server = build_server(config)  # no engine: only the interceptors and the deserializer answer
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                kind = channel.unary_stream if streaming else channel.unary_unary
                call = kind(method, request_serializer=lambda data: data, response_deserializer=lambda data: data)
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    reply = call(wire, timeout=10, metadata=metadata)
                    if streaming:
                        async for _ in reply:
                            pass
                    else:
                        await reply
                return raised.value
        finally:
            await server.stop(0)

    error = asyncio.run(scenario())
    assert error.code() == expected, error.details()
    if expected == grpc.StatusCode.INVALID_ARGUMENT:
        assert error.details().startswith(f"{method}: request not parsed")
