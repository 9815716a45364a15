"""The HTTP endpoints: parse the body, call the inference service, build the OpenAI response."""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from http_gateway import request_mapping as mapping
from http_gateway.disconnect import until_disconnect
from http_gateway.responses import Collected, chat_completion, completion, usage
from http_gateway.errors import permission_denied
from http_gateway.schemas import (
    ChatCompletionRequest, CompletionRenderRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, UnpinRequest,
    WarmRequest,
)
from http_gateway.sse import DONE, EventStreamResponse, encode
from http_gateway.state import Gateway, parse_body
from http_gateway.stream_chunks import ChatStream, CompletionStream
from http_gateway.upstream import CACHE_HEALTH_NAME, events
from kvboost.v1 import inference_pb2 as pb

logger = logging.getLogger(__name__)
router = APIRouter()


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    gateway, request_id = _gateway(request), request.state.request_id
    body = await parse_body(request, ChatCompletionRequest)
    model = await gateway.served_model(body.model)
    grpc_request = mapping.chat_request(body, request_id, gateway.config.default_max_tokens,
                                        gateway.cache_salt(request, body.cache_salt))
    _log_request(request_id, "chat", body, grpc_request)
    response_id, created = f"chatcmpl-{request_id}", int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        formatter = ChatStream(response_id, created, model, body.n, include_usage, body.logprobs)
        return await _stream(request, grpc_request, formatter)
    collected = await _collect(request, grpc_request)
    return _json(request, chat_completion(response_id, created, model, collected, body.logprobs))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    gateway, request_id = _gateway(request), request.state.request_id
    body = await parse_body(request, CompletionRequest)
    model = await gateway.served_model(body.model)
    grpc_request = mapping.completion_request(body, request_id, gateway.cache_salt(request, body.cache_salt))
    _log_request(request_id, "completion", body, grpc_request)
    echo_prompt = mapping.completion_prompt(body) if body.echo else None
    if echo_prompt == "" and grpc_request.segments:
        echo_prompt = "".join(grpc_request.segments)
    response_id, created, logprobs = f"cmpl-{request_id}", int(time.time()), body.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        formatter = CompletionStream(response_id, created, model, body.n, include_usage, logprobs,
                                     echo_prompt=echo_prompt)
        return await _stream(request, grpc_request, formatter)
    collected = await _collect(request, grpc_request)
    return _json(request, completion(response_id, created, model, collected, echo_prompt, logprobs))


def _log_request(request_id: str, kind: str, body, grpc_request: pb.GenerateRequest) -> None:
    logger.info("[%s] %s: n=%d max_tokens=%d temperature=%g stream=%s%s", request_id, kind, grpc_request.n,
                grpc_request.max_new_tokens, grpc_request.temperature, body.stream,
                f" user={body.user!r}" if body.user else "")


async def _collect(request: Request, grpc_request: pb.GenerateRequest) -> Collected:
    """Reads the whole Generate stream; the call is cancelled if the client leaves first."""
    gateway = _gateway(request)
    collected = Collected(max(1, grpc_request.n))
    call = gateway.upstream.generate(grpc_request)

    async def read_all() -> Collected:
        async for event in events(call):
            _maybe_observe_ttft(request, event)
            collected.add(event)
        return collected

    return await gateway.call(until_disconnect(request.receive, read_all()))


async def _stream(request: Request, grpc_request: pb.GenerateRequest, formatter) -> Response:
    """Waits for the first event (errors before it are HTTP statuses), then streams the rest as SSE."""
    gateway = _gateway(request)
    stream = events(gateway.upstream.generate(grpc_request))
    try:
        first = await until_disconnect(request.receive, anext(stream, None))
    except grpc.aio.AioRpcError as error:
        await stream.aclose()
        raise gateway.rpc_error(error) from None
    except BaseException:
        await stream.aclose()
        raise
    frames = _frames(request, formatter, first, stream)
    endpoint = request.url.path
    return EventStreamResponse(frames, {"X-Request-Id": request.state.request_id},
                               on_disconnect=lambda: _aborted(gateway, endpoint, request.state.request_id))


async def _frames(request: Request, formatter, first: pb.GenerateEvent, stream: AsyncIterator[pb.GenerateEvent]
                  ) -> AsyncIterator[bytes]:
    gateway = _gateway(request)
    try:
        for chunk in formatter.start():
            yield encode(chunk)
        event = first
        while event is not None:
            _maybe_observe_ttft(request, event)
            for chunk in formatter.on_event(event):
                yield encode(chunk)
            event = await anext(stream, None)
        for chunk in formatter.end():
            yield encode(chunk)
        gateway.metrics.record_usage(usage(formatter.results[index] for index in sorted(formatter.results)))
    except grpc.aio.AioRpcError as error:  # after the stream began: an error chunk, then [DONE]
        failure = gateway.rpc_error(error)
        gateway.metrics.errors.labels(str(failure.status), failure.type).inc()
        logger.info("[%s] failed while streaming: %s", request.state.request_id, failure)
        yield encode(failure.body())
    finally:
        await stream.aclose()
    yield DONE


def _maybe_observe_ttft(request: Request, event: pb.GenerateEvent) -> None:
    """Records the time to the first generated token, once per request."""
    if event.token_ids and not request.state.ttft_seen:
        request.state.ttft_seen = True
        _gateway(request).metrics.ttft.labels(request.url.path).observe(time.perf_counter() - request.state.arrival)


def _aborted(gateway: Gateway, endpoint: str, request_id: str) -> None:
    gateway.metrics.aborted.labels(endpoint).inc()
    logger.info("[%s] the client went away while streaming; the generation was cancelled", request_id)


def _json(request: Request, body: dict) -> JSONResponse:
    if body.get("usage"):
        _gateway(request).metrics.record_usage(body["usage"])
    return JSONResponse(body, headers={"X-Request-Id": request.state.request_id})


@router.get("/v1/models")
async def models(request: Request) -> Response:
    gateway = _gateway(request)
    info = await gateway.model_info()
    served = await gateway.served_model()
    return JSONResponse({"object": "list", "data": [{
        "id": served, "object": "model", "created": gateway.started, "owned_by": "kvboost", "root": info.model,
        "max_model_len": info.max_context, "dtype": info.dtype, "device": info.device,
    }]})


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    gateway = _gateway(request)
    body = await parse_body(request, TokenizeRequest)
    await gateway.served_model(body.model)
    reply = await gateway.call(gateway.upstream.tokenize(mapping.tokenize_request(body)))
    return JSONResponse({"count": len(reply.token_ids), "max_model_len": reply.max_context,
                         "tokens": list(reply.token_ids),
                         "token_strs": list(reply.tokens) if body.return_token_strs else None})


@router.post("/v1/chat/completions/render")
async def chat_completions_render(request: Request) -> Response:
    """The token ids the chat request would prefill (vLLM's render; vllm-router's kv_aware policy asks each
    replica), read through the same check and tokenization cache as the request itself."""
    gateway, request_id = _gateway(request), request.state.request_id
    body = await parse_body(request, ChatCompletionRequest)
    await gateway.served_model(body.model)
    grpc_request = mapping.chat_request(body, request_id, gateway.config.default_max_tokens)
    return await _render(request, grpc_request)


@router.post("/v1/completions/render")
async def completions_render(request: Request) -> Response:
    """The token ids the completion request would prefill (see chat_completions_render)."""
    gateway, request_id = _gateway(request), request.state.request_id
    body = await parse_body(request, CompletionRenderRequest)
    await gateway.served_model(body.model)
    return await _render(request, mapping.completion_request(body, request_id))


async def _render(request: Request, grpc_request: pb.GenerateRequest) -> Response:
    gateway = _gateway(request)
    reply = await gateway.call(gateway.upstream.tokenize(mapping.render_request(grpc_request)))
    return _json(request, {"token_ids": list(reply.token_ids), "count": len(reply.token_ids),
                           "max_model_len": reply.max_context})


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    gateway = _gateway(request)
    body = await parse_body(request, DetokenizeRequest)
    await gateway.served_model(body.model)
    reply = await gateway.call(gateway.upstream.detokenize(body.tokens))
    return JSONResponse({"prompt": reply.text})


@router.post("/v1/kvboost/warm")
async def warm(request: Request) -> Response:
    """Computes and stores a text's or chat prefix's chunks in the caller's cache scope; `pin` needs an admin key."""
    gateway = _gateway(request)
    body = await parse_body(request, WarmRequest)
    await gateway.served_model(body.model)
    if body.pin and not request.state.caller.admin:
        raise permission_denied("pinned chunks are never evicted, so pinning needs an admin key; warm without "
                                "`pin`", "pin")
    grpc_request = mapping.warm_request(body, gateway.cache_salt(request, body.cache_salt, body.tenant))
    result = await gateway.call(until_disconnect(request.receive, gateway.upstream.warm(grpc_request)))
    return JSONResponse({"object": "kvboost.warm", "chunks_stored": result.chunks_stored,
                         "token_count": result.token_count, "chunk_size": result.chunk_size,
                         "chunk_boundary_aligned": result.chunk_boundary_aligned,
                         "partial_tail_tokens": result.partial_tail_tokens,
                         "alignment_warning": result.alignment_warning})


@router.post("/v1/kvboost/unpin")
async def unpin(request: Request) -> Response:
    """Makes the chunks a pinned warm-up of the same text (or messages) stored evictable again; admin keys only."""
    gateway = _gateway(request)
    body = await parse_body(request, UnpinRequest)
    await gateway.served_model(body.model)
    if not request.state.caller.admin:
        raise permission_denied("unpinning needs an admin key, as pinning does")
    grpc_request = mapping.warm_request(body, gateway.cache_salt(request, body.cache_salt, body.tenant))
    result = await gateway.call(gateway.upstream.unpin(grpc_request))
    return JSONResponse({"object": "kvboost.unpin", "chunks_unpinned": result.chunks_unpinned,
                         "token_count": result.token_count})


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when the inference service's gRPC health says SERVING, else 503; `cache` shows the daemon as the
    service sees it (the service still serves, without reuse, while it is NOT_SERVING)."""
    upstream = _gateway(request).upstream
    service, cache = await upstream.health_status(), await upstream.health_status(CACHE_HEALTH_NAME)
    ok = service == "SERVING"
    return JSONResponse({"status": "ok" if ok else "unavailable", "service": service, "cache": cache},
                        status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_gateway(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
