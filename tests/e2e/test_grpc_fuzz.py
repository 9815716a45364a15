"""The cache daemon and the inference service (tiny model), as real processes, fed messages generated from their
proto descriptors (every field type, edge values, unknown enum numbers and unknown fields): every reply OK or a
client's error, both servers still up, and an ordinary Generate answering the same before and after."""
from __future__ import annotations


import grpc
import pytest

from kvboost.v1 import cache_pb2, inference_pb2
from kvboost.v1 import inference_pb2 as pb
from tests.e2e.grpc_fuzz import fuzz_service
from tests.e2e.service_process import generate
from tests.e2e.tiny_stack import tiny_daemon_and_service

MAX_EXAMPLES = 40  # per RPC: about 800 messages to the two servers in about 30 s on 2 cores
SEED = 20261126
ORDINARY = dict(max_new_tokens=6, mode=pb.PREFIX_CACHE)  # greedy (temperature 0)
ORDINARY_PROMPT = "The harbour ferry leaves at six. " * 2
CACHE_SERVICE = cache_pb2.DESCRIPTOR.services_by_name["CacheService"]
INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with tiny_daemon_and_service(tmp_path_factory.mktemp("grpc-fuzz"), "--chunk-size", "8", "--max-new-tokens", "16",
                                 "--max-prompt-tokens", "256") as (daemon, service, _):
        yield daemon, service


def ordinary_answer(service) -> list[int]:
    with service.stub() as stub:
        events, result = generate(stub, ORDINARY_PROMPT, **ORDINARY)
    return [token_id for event in events for token_id in event.token_ids]


@pytest.mark.e2e
def test_generated_messages_get_ok_or_a_client_error_and_leave_both_servers_serving(servers):
    daemon, service = servers
    before = ordinary_answer(service)
    with grpc.insecure_channel(daemon.address) as channel:
        cache_report = fuzz_service(channel, CACHE_SERVICE, MAX_EXAMPLES, SEED, endless=frozenset({"WatchEvents"}))
    with grpc.insecure_channel(service.address) as channel:
        service_report = fuzz_service(channel, INFERENCE_SERVICE, MAX_EXAMPLES, SEED)
    assert daemon.process.poll() is None and service.process.poll() is None, "both servers still up"
    assert ordinary_answer(service) == before, "an ordinary Generate answers the same after the fuzzing"
    for report, service_descriptor in ((cache_report, CACHE_SERVICE), (service_report, INFERENCE_SERVICE)):
        assert report.failures == []
        called = {method for method, _ in report.statuses}
        assert called == {method.name for method in service_descriptor.methods}, "every RPC was called"
        assert report.by_status().get("OK", 0) > 0 and report.by_status().get("INVALID_ARGUMENT", 0) > 0, report.statuses
    print(f"cache daemon: {cache_report.num_messages} calls {cache_report.by_status()}; "
          f"inference service: {service_report.num_messages} calls {service_report.by_status()}")
