"""In-process fake servers built from the generated stubs, for the client library and CLI tests."""
from __future__ import annotations

import threading
from concurrent import futures
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvboost.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc

FAKE_CHUNK_SIZE = 4
KEY_A = bytes(range(32))
KEY_B = bytes(range(32, 64))
NAMESPACE = b"\xab" * 32


def make_result(**overrides) -> inference_pb2.GenerationResult:
    values = dict(
        output_text="Hello world", generated_tokens=2, ttft_ms=12.5, total_ms=20.0, tokens_per_sec=100.0,
        kv_reuse_ratio=0.75, prompt_tokens=8, cached_tokens=6, recomputed_tokens=1,
        mode=inference_pb2.PREFIX_CACHE, finish_reason="length", output_token_ids=[11, 12],
        degraded=False, request_id="req-1",
    )
    values.update(overrides)
    return inference_pb2.GenerationResult(**values)


class _Recorder:
    """Keeps every request and its invocation metadata, in call order."""

    def __init__(self) -> None:
        self.requests: list = []
        self.metadata: list[dict[str, str]] = []

    def _record(self, request, context) -> None:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))


class FakeInference(_Recorder, inference_pb2_grpc.InferenceServiceServicer):
    """Answers from canned values; records every request and its metadata.

    Prompts that steer it: "invalid" aborts INVALID_ARGUMENT, "busy" aborts RESOURCE_EXHAUSTED,
    "slow" blocks until `release` is set (to test deadlines), "noresult" ends without a result.
    """

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def Generate(self, request, context):
        self._record(request, context)
        prompt = request.prompt or " ".join(message.content for message in request.messages)
        if prompt == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty after templating")
        if prompt == "busy":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (8 waiting)")
        if prompt == "slow":
            self.release.wait(10)
        yield inference_pb2.GenerateEvent(text="Hello", token_ids=[11])
        yield inference_pb2.GenerateEvent(text=" world", token_ids=[12])
        if prompt != "noresult":
            yield inference_pb2.GenerateEvent(result=make_result(mode=request.mode or inference_pb2.PREFIX_CACHE))

    def _batch(self, request, context):
        self._record(request, context)
        results = [make_result(output_text=f"echo:{item.prompt}", request_id=item.request_id)
                   for item in request.requests]
        return inference_pb2.GenerateBatchReply(results=results)

    GenerateBatch = _batch
    GenerateMany = _batch

    def Warm(self, request, context):
        self._record(request, context)
        if not request.text and not request.messages:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text is required")
        tokens = len(request.text.split()) or len(request.messages) * 3
        tail = tokens % FAKE_CHUNK_SIZE
        return inference_pb2.WarmResult(
            chunks_stored=tokens // FAKE_CHUNK_SIZE, token_count=tokens, chunk_size=FAKE_CHUNK_SIZE,
            chunk_boundary_aligned=tail == 0, partial_tail_tokens=tail,
            alignment_warning=f"{tail} tail tokens not stored" if tail else "",
        )


    def Unpin(self, request, context):
        self._record(request, context)
        tokens = len(request.text.split())
        return inference_pb2.UnpinResult(chunks_unpinned=-(-tokens // FAKE_CHUNK_SIZE), token_count=tokens)
    def VerifyCorrectness(self, request, context):
        self._record(request, context)
        prompts = list(request.prompts) or ["built-in one", "built-in two"]
        checks = [inference_pb2.PromptVerification(
            prompt=prompt, token_identical=prompt != "differs", first_token_cosine=1.0, first_token_kl=0.0,
            matching_prefix_tokens=32, cached_tokens=128, baseline_text="a", cached_text="a")
            for prompt in prompts]
        identical = sum(check.token_identical for check in checks)
        return inference_pb2.VerifyReport(prompts=checks, identical=identical, total=len(checks))

    def Stats(self, request, context):
        self._record(request, context)
        return inference_pb2.ServiceStatsReply(
            requests=7, rejected=1, prompt_tokens=2**40, cached_tokens=900, degraded=True,
            cache_address="127.0.0.1:50052", queue_depth=2, mean_ttft_ms=33.25,
        )

    def ModelInfo(self, request, context):
        self._record(request, context)
        return inference_pb2.ModelInfoReply(
            model="tiny", architecture="LlamaForCausalLM", dtype="float32", device="cpu", num_layers=2,
            num_kv_heads=2, head_dim=16, max_context=4096, chunk_size=FAKE_CHUNK_SIZE, kv_cache_bits=16,
            namespace_hex="ab" * 32, default_recompute_strategy=inference_pb2.SELECTIVE,
        )


class FakeCache(_Recorder, cache_pb2_grpc.CacheServiceServicer):
    """Knows KEY_A and KEY_B in NAMESPACE; records requests and metadata."""

    def Stats(self, request, context):
        self._record(request, context)
        namespaces = [cache_pb2.NamespaceStats(namespace=NAMESPACE, entries=2, bytes=2048, pinned=1)]
        return cache_pb2.CacheStatsReply(entries=2, bytes=2048, max_bytes=2**33, hits=5, misses=3,
                                         evictions=0, map_size=2**30, namespaces=namespaces)

    def Delete(self, request, context):
        self._record(request, context)
        if request.namespace and request.namespace != NAMESPACE:
            context.abort(grpc.StatusCode.NOT_FOUND, "namespace has no entries")
        deleted = 2 if request.namespace else sum(key in (KEY_A, KEY_B) for key in request.keys)
        return cache_pb2.DeleteReply(deleted=deleted, bytes_freed=1024 * deleted)

    def _pin(self, request, context):
        self._record(request, context)
        missing = [key for key in request.keys if key not in (KEY_A, KEY_B)]
        if len(missing) == len(request.keys):
            context.abort(grpc.StatusCode.NOT_FOUND, "none of the keys exist")
        return cache_pb2.PinReply(updated=len(request.keys) - len(missing), missing=missing)

    Pin = _pin
    Unpin = _pin


@contextmanager
def running_server(inference=None, cache=None, token: str | None = None):
    """A started gRPC server on a free loopback port with the given servicers and a health service;
    yields its address and always stops it. With `token`, calls without the bearer token fail."""
    interceptors = [_TokenInterceptor(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=interceptors)
    if inference is not None:
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(inference, server)
    if cache is not None:
        cache_pb2_grpc.add_CacheServiceServicer_to_server(cache, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if inference is not None:
            inference.release.set()
        server.stop(grace=None)


class _TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata)
        if metadata.get("authorization") == self._expected:
            return continuation(handler_call_details)
        return self._refuse
