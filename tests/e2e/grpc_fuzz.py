"""Every RPC of a gRPC service fed messages generated from its descriptors (tests/proto_strategies.py), sent as
wire bytes so unknown fields reach the server; each reply's status counted. Used by tests/e2e/test_grpc_fuzz.py."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from tests.proto_strategies import wire_messages

# What a server may answer a message it cannot serve: a client's error, never its own failure (INTERNAL, UNKNOWN,
# DATA_LOSS) nor a fall (UNAVAILABLE).
CLIENT_ERRORS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
                           grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED})
WATCH_S = 0.3  # server streams that never end by themselves (WatchEvents) are read this long, then cut
CALL_TIMEOUT_S = 120.0


@dataclass
class RpcReport:
    statuses: Counter = field(default_factory=Counter)  # (method, status name) -> replies
    failures: list[str] = field(default_factory=list)  # a status outside OK and CLIENT_ERRORS, with its request

    @property
    def num_messages(self) -> int:
        return sum(self.statuses.values())

    def by_status(self) -> dict[str, int]:
        totals: Counter = Counter()
        for (_, status), count in self.statuses.items():
            totals[status] += count
        return dict(sorted(totals.items()))

    def add(self, other: RpcReport) -> None:
        self.statuses.update(other.statuses)
        self.failures += other.failures


def _identity(data: bytes) -> bytes:
    return data


def call(channel: grpc.Channel, service: ServiceDescriptor, method: MethodDescriptor, requests: list[bytes],
         endless: bool) -> grpc.StatusCode:
    """Sends `requests` (one unless the RPC streams them) and reads the whole reply; its status."""
    path = f"/{service.full_name}/{method.name}"
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    rpc = kind(path, request_serializer=_identity, response_deserializer=_identity)
    argument = iter(requests) if method.client_streaming else requests[0]
    try:
        if method.server_streaming:
            for _ in rpc(argument, timeout=WATCH_S if endless else CALL_TIMEOUT_S):
                pass
        else:
            rpc(argument, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        if endless and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return grpc.StatusCode.OK  # it was still streaming when cut
        return error.code()
    return grpc.StatusCode.OK


def fuzz_service(channel: grpc.Channel, service: ServiceDescriptor, max_examples: int, seed: int,
                 endless: frozenset[str] = frozenset(), skip: frozenset[str] = frozenset(),
                 stop_at_failure: bool = True) -> RpcReport:
    """max_examples generated messages for each method of `service` (a client stream gets 0..3 of them).
    stop_at_failure: raise (Hypothesis then shrinks to the least message that fails) instead of counting on."""
    report = RpcReport()
    for method in service.methods:
        if method.name not in skip:
            _fuzz_method(channel, service, method, report, max_examples, seed, method.name in endless,
                         stop_at_failure)
    return report


def _fuzz_method(channel: grpc.Channel, service: ServiceDescriptor, method: MethodDescriptor, report: RpcReport,
                 max_examples: int, seed: int, endless: bool, stop_at_failure: bool) -> None:
    one = wire_messages(method.input_type)
    requests = st.lists(one, max_size=3) if method.client_streaming else st.lists(one, min_size=1, max_size=1)

    @hypothesis_seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate, Phase.shrink] if stop_at_failure else [Phase.generate], print_blob=False)
    @given(requests)
    def send(batch: list[bytes]) -> None:
        status = call(channel, service, method, batch, endless)
        report.statuses[(method.name, status.name)] += 1
        if status != grpc.StatusCode.OK and status not in CLIENT_ERRORS:
            report.failures.append(f"{method.name} -> {status.name}: {[b[:200] for b in batch]!r}"[:800])
            assert not stop_at_failure, report.failures[-1]

    send()
