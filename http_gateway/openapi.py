"""The OpenAPI document: each endpoint's request body (from schemas.py), its answers and OpenAI's error body.

The endpoints read their raw body themselves (state.parse_body) so that a bad one is a 400 in OpenAI's shape
that names what to fix, never FastAPI's 422; this module tells the document what they accept and answer.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from http_gateway.schemas import (
    ChatCompletionRequest, CompletionRenderRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, UnpinRequest,
    WarmRequest,
)

REF = "#/components/schemas/{model}"
JSON = "application/json"
_INT = {"type": "integer"}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": ["string", "null"]}


def _object(properties: dict[str, Any], **keywords: Any) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), **keywords}


def _ref(name: str) -> dict:
    return {"$ref": REF.format(model=name)}


_USAGE = _object({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                  "prompt_tokens_details": _object({"cached_tokens": _INT})})
_KVBOOST = {"type": ["object", "null"], "description": "KVBoost's figures of the request (OpenAI clients ignore it)"}
_FINISH = {"enum": ["stop", "length", "abort"]}
# One server-sent event of a stream (OpenAPI 3.1 reads an event stream's schema as each event's): its data is a
# chunk as JSON text (chat.completion.chunk, text_completion, an error), the last one `[DONE]`.
_SSE = {"text/event-stream": {"schema": {"type": "object", "properties": {"data": _STR}, "required": ["data"]}}}

RESPONSE_SCHEMAS: dict[str, dict] = {
    "ErrorResponse": _object({"error": _object({"message": _STR, "type": _STR, "param": _NULLABLE_STR,
                                                "code": _NULLABLE_STR})}),
    "Usage": _USAGE,
    "ChatCompletion": _object({
        "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
        "choices": {"type": "array", "items": _object({
            "index": _INT, "message": _object({"role": {"const": "assistant"}, "content": _STR}),
            "logprobs": {"type": ["object", "null"]}, "finish_reason": _FINISH})},
        "usage": _ref("Usage"), "system_fingerprint": {"type": "null"}, "kvboost": _KVBOOST}),
    "Completion": _object({
        "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
        "choices": {"type": "array", "items": _object({
            "index": _INT, "text": _STR, "logprobs": {"type": ["object", "null"]}, "finish_reason": _FINISH})},
        "usage": _ref("Usage"), "system_fingerprint": {"type": "null"}, "kvboost": _KVBOOST}),
    "ModelList": _object({"object": {"const": "list"}, "data": {"type": "array", "items": _object({
        "id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "root": _STR,
        "max_model_len": _INT, "dtype": _STR, "device": _STR})}}),
    "TokenizeResult": _object({"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT},
                               "token_strs": {"type": ["array", "null"], "items": _STR}}),
    "DetokenizeResult": _object({"prompt": _STR}),
    "RenderResult": _object({"token_ids": {"type": "array", "items": _INT}, "count": _INT, "max_model_len": _INT}),
    "WarmResult": _object({"object": {"const": "kvboost.warm"}, "chunks_stored": _INT, "token_count": _INT,
                           "chunk_size": _INT, "chunk_boundary_aligned": {"type": "boolean"},
                           "partial_tail_tokens": _INT, "alignment_warning": _STR}),
    "UnpinResult": _object({"object": {"const": "kvboost.unpin"}, "chunks_unpinned": _INT, "token_count": _INT}),
    "Health": _object({"status": {"enum": ["ok", "unavailable"]}, "service": _STR, "cache": _STR}),
}

_ERRORS = {
    400: "the body is not JSON, does not fit the schema, or asks what this server does not do (`param` names "
         "the field); never FastAPI's 422: OpenAI's API answers 400 to an invalid body",
    401: "missing or wrong API key (`Authorization: Bearer <key>`)",
    403: "an admin key is needed (pins, another tenant's scope)",
    404: "another model than the served one (`model_not_found`)",
    413: "the body is over --max-body-bytes, or the request over the service's --max-message-bytes",
    429: "more than --max-concurrent-requests in flight, or the service's queue is full (`Retry-After`)",
    500: "a failure in the gateway or the service that is not the request's fault",
    503: "the inference service cannot be reached, or is loading or shutting down",
    504: "the service did not answer within --timeout",
}
_GATE = (401, 413, 429)  # the middleware's refusals, before any endpoint
_UPSTREAM = (500, 503, 504)  # a call to the service
_BODY = (400, 403, 404)  # a body checked, a model named, a service that refuses

# (path, method) -> (request body model, 200 schema name, extra 200 media types, error statuses)
_OPERATIONS: dict[tuple[str, str], tuple[type[BaseModel] | None, str, dict, tuple[int, ...]]] = {
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, "ChatCompletion", _SSE, _GATE + _BODY + _UPSTREAM),
    ("/v1/completions", "post"): (CompletionRequest, "Completion", _SSE, _GATE + _BODY + _UPSTREAM),
    ("/tokenize", "post"): (TokenizeRequest, "TokenizeResult", {}, _GATE + _BODY + _UPSTREAM),
    ("/v1/chat/completions/render", "post"): (ChatCompletionRequest, "RenderResult", {}, _GATE + _BODY + _UPSTREAM),
    ("/v1/completions/render", "post"): (CompletionRenderRequest, "RenderResult", {}, _GATE + _BODY + _UPSTREAM),
    ("/detokenize", "post"): (DetokenizeRequest, "DetokenizeResult", {}, _GATE + _BODY + _UPSTREAM),
    ("/v1/kvboost/warm", "post"): (WarmRequest, "WarmResult", {}, _GATE + _BODY + _UPSTREAM),
    ("/v1/kvboost/unpin", "post"): (UnpinRequest, "UnpinResult", {}, _GATE + _BODY + _UPSTREAM),
    ("/v1/models", "get"): (None, "ModelList", {}, _GATE + _UPSTREAM),
    ("/health", "get"): (None, "Health", {}, (503,)),
}

# Answers that feed another call (OpenAPI links; a stateful fuzzer follows them): a tokenization back to its text,
# and a warm-up's pins undone with the same body.
_LINKS: dict[tuple[str, str], dict[str, tuple[str, Any]]] = {
    ("/tokenize", "post"): {"Detokenize": ("/detokenize", {"tokens": "$response.body#/tokens"})},
    ("/v1/kvboost/warm", "post"): {"Unpin": ("/v1/kvboost/unpin", "$request.body")},
}


def request_schemas() -> dict[str, dict]:
    """The request models' JSON schemas (validation side), by model name, with refs into components."""
    models = sorted({body for body, *_ in _OPERATIONS.values() if body is not None}, key=lambda model: model.__name__)
    _, top = models_json_schema([(model, "validation") for model in models], ref_template=REF)
    return top["$defs"]


def _document_operation(operation: dict, path: str, method: str) -> None:
    body, success, other_media, statuses = _OPERATIONS[(path, method)]
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": _ref(body.__name__)}}}
    operation["responses"] = {"200": {"description": "OK", "content": {JSON: {"schema": _ref(success)},
                                                                          **other_media}}}
    for status in statuses:
        description = "the service is not SERVING" if path == "/health" else _ERRORS[status]
        schema = _ref("Health") if path == "/health" else _ref("ErrorResponse")
        operation["responses"][str(status)] = {"description": description, "content": {JSON: {"schema": schema}}}


def openapi_document(app: FastAPI, protected: bool, open_paths: frozenset[str], tenants: bool) -> dict:
    """The document FastAPI serves at /openapi.json. protected: the gateway checks API keys (bearer) on every
    path but `open_paths`. tenants: a keys file names tenants (else `tenant` can only be null)."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description="OpenAI-compatible HTTP in front of KVBoost's inference service. Invalid "
                                       "bodies are 400 with OpenAI's error body, as OpenAI's API answers.")
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            if (path, method) in _OPERATIONS:
                _document_operation(operation, path, method)
            elif path == "/metrics":
                operation["responses"] = {"200": {"description": "Prometheus exposition",
                                                  "content": {"text/plain": {"schema": _STR}}}}
            for name, (target, body) in _LINKS.get((path, method), {}).items():
                operation["responses"]["200"]["links"] = {name: {
                    "operationId": document["paths"][target]["post"]["operationId"], "requestBody": body}}
            if protected and path not in open_paths:
                operation["security"] = [{"bearer": []}]
    components = document.setdefault("components", {})
    components.setdefault("schemas", {}).update({**request_schemas(), **RESPONSE_SCHEMAS})
    if not tenants:
        for name in ("WarmRequest", "UnpinRequest"):
            components["schemas"][name]["properties"]["tenant"] = {
                "type": "null", "description": "admin keys only: a tenant of the gateway's --keys-file (it has none)"}
    if protected:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def install(app: FastAPI, protected: bool, open_paths: frozenset[str], tenants: bool) -> None:
    """Makes app.openapi() build (once) the document above."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, protected, open_paths, tenants)
        return app.openapi_schema

    app.openapi = openapi
