"""Reuse inside a chunk through the running processes: a follow-up question on a document reuses every token it
shares with the first question's stored chunks, read from the daemon's memory map (co-located) or over
Fetch, and the greedy answer equals plain model.generate."""
from __future__ import annotations

import grpc
import pytest

from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from tests.conftest import pick_free_port, wait_for
from tests.e2e.daemon_process import start_daemon
from tests.e2e.service_process import running_service
from tests.e2e.stack_process import reference_ids, save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHUNK_SIZE = 16
DOCUMENT = "Ferries leave pier three at nine and pier five at ten; the last one sails at six. "  # 83 tokens
FIRST, SECOND = "Q: when does pier three leave?", "Q: when does the last one sail?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("local_read", ["auto", "off"])
def test_a_follow_up_reuses_to_the_last_shared_token(tmp_path, model_dir, local_read):
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port())
    try:
        with running_service(str(model_dir), daemon.address, pick_free_port(), tmp_path / "service.log",
                             "--chunk-size", str(CHUNK_SIZE), "--cache-local-read", local_read) as service, \
                grpc.insecure_channel(service.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)

            def ask(question: str) -> pb.GenerationResult:
                prompt = DOCUMENT + question
                result = list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=8, mode=pb.PREFIX_CACHE),
                                            timeout=60))[-1].result
                assert list(result.output_token_ids) == reference_ids(model_dir, prompt, 8)
                return result

            ask(FIRST)
            # The first request's chunks (whole ones, then its tail with the answer) are written back in the
            # background: wait for them before the follow-up.
            expected_chunks = (len(DOCUMENT + FIRST) + 8 - 1) // CHUNK_SIZE + 1
            wait_for(lambda: stub.Stats(pb.ServiceStatsRequest(), timeout=10).chunks_stored >= expected_chunks,
                     timeout_s=30, what="the first request's write-back")
            second = ask(SECOND)
            shared = len(DOCUMENT) + len("Q: when does ")  # one token per character
            assert second.cached_tokens == shared  # 6 whole chunks, then 12 tokens of the 7th
            stats = stub.Stats(pb.ServiceStatsRequest(), timeout=10)
            assert stats.partial_cached_tokens >= shared % CHUNK_SIZE
            assert stats.read_mode == ("locked_map" if local_read == "auto" else "remote")
    finally:
        daemon.terminate()
