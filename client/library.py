"""Python client of the KVBoost inference service: streamed generation, batches, warm-up, stats."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import grpc

from kvboost.v1 import inference_pb2, inference_pb2_grpc

from client.channel import RpcChannel
from client.errors import KVBoostError, from_rpc_error
from client.request_builders import (
    MessageLike,
    RequestLike,
    build_batch_request,
    build_generate_request,
    build_warm_request,
    parse_mode,
)
from client.results import GenerationResult, ModelInfo, ServiceStats, UnpinResult, VerifyReport, WarmResult

DEFAULT_ADDRESS = "127.0.0.1:50051"
# Generation on a CPU can take minutes for long prompts; calls fail after this many seconds.
DEFAULT_TIMEOUT_S = 300.0


class GenerationStream:
    """One Generate call: iterating yields the text pieces as they are decoded; `.result` is the
    GenerationResult of the last event (reading it first consumes the rest of the stream)."""

    def __init__(self, call, address: str, timeout: float | None) -> None:
        self._call = call
        self._address = address
        self._timeout = timeout
        self._result: GenerationResult | None = None
        self._pieces: list[str] = []
        self._consumed = False

    def __iter__(self) -> Iterator[str]:
        if self._consumed:
            return
        self._consumed = True
        try:
            for event in self._call:
                if event.text:
                    self._pieces.append(event.text)
                    yield event.text
                if event.HasField("result"):
                    self._result = GenerationResult.from_proto(event.result)
        except grpc.RpcError as error:
            raise from_rpc_error(error, "Generate", self._address, self._timeout) from None
        if self._result is None:
            raise KVBoostError(f"the Generate stream from {self._address} ended without a result")

    @property
    def result(self) -> GenerationResult:
        for _ in self:
            pass
        if self._result is None:
            raise KVBoostError("the Generate stream was cancelled before its result arrived")
        return self._result

    @property
    def text(self) -> str:
        """The text streamed so far."""
        return "".join(self._pieces)

    def cancel(self) -> None:
        """Stops the call; the server stops decoding."""
        self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self._call.cancel()


class KVBoostClient:
    """Client of kvboost.v1.InferenceService.

    Args:
        address: host:port of the inference service.
        token: bearer token sent as `authorization` metadata when the service requires one.
        timeout: default seconds per call (a Generate stream as a whole); None waits forever.
        credentials: TLS channel credentials; None means a plaintext channel.

    Every method raises a KVBoostError subclass (client.errors) when the call fails.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._rpc = RpcChannel(address, token, timeout, credentials)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._rpc.channel)

    @property
    def address(self) -> str:
        return self._rpc.address

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **options
    ) -> GenerationStream:
        """Starts a Generate call; see `build_generate_request` for the options (messages, segments,
        max_new_tokens, mode, temperature, top_p, top_k, seed, stop, recompute_strategy, ...)."""
        request = build_generate_request(prompt, **options)
        deadline = self._rpc.deadline(timeout)
        call = self._stub.Generate(request, timeout=deadline, metadata=self._rpc.metadata)
        return GenerationStream(call, self.address, deadline)

    def generate_batch(
        self, requests: Iterable[RequestLike], *, timeout: float | None = None
    ) -> list[GenerationResult]:
        """Prompts that share a prefix, run as one batch; results in input order."""
        reply = self._rpc.call("GenerateBatch", self._stub.GenerateBatch, build_batch_request(requests), timeout)
        return [GenerationResult.from_proto(result) for result in reply.results]

    def generate_many(
        self, requests: Iterable[RequestLike], *, timeout: float | None = None
    ) -> list[GenerationResult]:
        """Any prompts; the server groups them by shared prefix. Results in input order."""
        reply = self._rpc.call("GenerateMany", self._stub.GenerateMany, build_batch_request(requests), timeout)
        return [GenerationResult.from_proto(result) for result in reply.results]

    def warm(
        self,
        text: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        content_addressed: bool = False,
        pin: bool = False,
        timeout: float | None = None,
    ) -> WarmResult:
        """Computes and stores every full chunk of `text` (or of the chat prefix `messages`)."""
        request = build_warm_request(text, messages=messages, content_addressed=content_addressed, pin=pin)
        return WarmResult.from_proto(self._rpc.call("Warm", self._stub.Warm, request, timeout))

    def unpin(
        self,
        text: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        content_addressed: bool = False,
        timeout: float | None = None,
    ) -> UnpinResult:
        """Clears the pins a `warm(..., pin=True)` of the same text (or messages) set: those chunks may be evicted."""
        request = build_warm_request(text, messages=messages, content_addressed=content_addressed)
        return UnpinResult.from_proto(self._rpc.call("Unpin", self._stub.Unpin, request, timeout))

    def verify_correctness(
        self,
        prompts: Sequence[str] = (),
        *,
        max_new_tokens: int | None = None,
        mode: str | int | None = None,
        timeout: float | None = None,
    ) -> VerifyReport:
        """Runs BASELINE against a cached mode (default PREFIX_CACHE) on `prompts` or built-in ones.

        It compares the service's own modes with each other, not with plain transformers: identity with
        `model.generate` is what the test suite checks (tests/inference_service/test_identity.py).
        """
        request = inference_pb2.VerifyRequest(
            prompts=list(prompts), max_new_tokens=max_new_tokens or 0, mode=parse_mode(mode)
        )
        reply = self._rpc.call("VerifyCorrectness", self._stub.VerifyCorrectness, request, timeout)
        return VerifyReport.from_proto(reply)

    def stats(self, *, timeout: float | None = None) -> ServiceStats:
        reply = self._rpc.call("Stats", self._stub.Stats, inference_pb2.ServiceStatsRequest(), timeout)
        return ServiceStats.from_proto(reply)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        reply = self._rpc.call("ModelInfo", self._stub.ModelInfo, inference_pb2.ModelInfoRequest(), timeout)
        return ModelInfo.from_proto(reply)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the service accepts connections; UnavailableError after `timeout` seconds."""
        self._rpc.wait_ready(timeout)

    def close(self) -> None:
        self._rpc.close()

    def __enter__(self) -> KVBoostClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
