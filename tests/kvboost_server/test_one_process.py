"""`python -m kvboost_server`: the gateway and the service in one process, through the in-process transport. The
same answers as the gRPC contract (which it still serves) and as model.generate, the gateway's statuses for bad
input, disconnects that stop the model, deadlines, and a graceful stop."""
from __future__ import annotations

import json
import re
import socket
import time
import uuid
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from tests.conftest import pick_free_port, wait_for
from tests.e2e.child_process import ChildProcess
from tests.e2e.one_process import start_one_process
from tests.e2e.daemon_process import start_daemon
from tests.e2e.stack_process import reference_ids, save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def start_server(model_dir: Path, daemon_address: str, log_path: Path, *gateway_flags: str) -> tuple[ChildProcess, str]:
    return start_one_process(str(model_dir), daemon_address, log_path, ("--chunk-size", "16"), gateway_flags)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-process")
    model_dir = save_tiny_model(folder / "tiny-model")
    daemon = start_daemon(folder / "lmdb", pick_free_port())
    server, grpc_address = start_server(model_dir, daemon.address, folder / "server.log")
    try:
        yield server, grpc_address, model_dir, daemon.address, folder
    finally:
        status = server.terminate()
        daemon.terminate()
        assert status == 0, f"kvboost_server exited with {status} on SIGTERM:\n{server.log()}"


def client(server: ChildProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.address}/v1", api_key="unused", max_retries=0, timeout=120)


def test_answers_are_model_generate_and_the_grpc_contracts(one_process):
    server, grpc_address, model_dir, _, _ = one_process
    prompt = f"[{uuid.uuid4().hex}] The ferry timetable says"
    expected_ids = reference_ids(model_dir, prompt, 12)
    with grpc.insecure_channel(grpc_address) as channel:  # the gRPC contract is still served
        events = list(inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(prompt=prompt, max_new_tokens=12), timeout=60))
    assert list(events[-1].result.output_token_ids) == expected_ids
    for _ in range(2):  # a miss, then a hit through the daemon
        reply = client(server).completions.create(model=str(model_dir), prompt=prompt, max_tokens=12, temperature=0)
        assert reply.choices[0].text == events[-1].result.output_text
        streamed = client(server).completions.create(model=str(model_dir), prompt=prompt, max_tokens=12,
                                                     temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == events[-1].result.output_text
    models = client(server).models.list()
    assert [model.id for model in models.data] == [str(model_dir)]


def test_bad_input_gets_the_gateways_statuses(one_process):
    server, _, model_dir, _, _ = one_process
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the gateway's own check
        client(server).completions.create(model=str(model_dir), prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="over the server's limit"):  # the servicer's, as over gRPC
        client(server).completions.create(model=str(model_dir), prompt="hi", max_tokens=10**6)
    tokens = httpx.post(f"{server.address}/tokenize", json={"model": str(model_dir), "prompt": "ferry"}, timeout=30)
    assert tokens.status_code == 200 and tokens.json()["tokens"]
    back = httpx.post(f"{server.address}/detokenize", json={"model": str(model_dir), "tokens": tokens.json()["tokens"]},
                      timeout=30)
    assert back.status_code == 200 and back.json()["prompt"] == "ferry"


def test_a_client_that_leaves_stops_its_request(one_process):
    server, _, model_dir, _, _ = one_process
    request_id = uuid.uuid4().hex
    # ignore_eos: no early end; 8 choices: more work and output than the tiny model gets through, or the socket
    # buffers hold, before the client is gone.
    payload = json.dumps({"model": str(model_dir), "prompt": f"[{request_id}] Go on:", "max_tokens": 4000,
                          "temperature": 0, "stream": True, "ignore_eos": True, "n": 8}).encode()
    host, port = server.address.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: server\r\nContent-Type: application/json\r\n"
                           + f"X-Request-Id: {request_id}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                           + payload)
        received = b""
        while b"data: " not in received:  # the first event is out: the model is on the request
            chunk = connection.recv(4096)
            assert chunk, f"the server closed the connection first: {received[:300]!r}"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received[:300]
        connection.shutdown(socket.SHUT_RDWR)  # gone, explicitly (no client library deciding when)
    wait_for(lambda: re.search(rf"\[{request_id}\] .*\(cancelled\)", server.log()), "the request to be cancelled",
             timeout_s=60)


def test_a_request_past_the_gateways_deadline_is_a_504_and_the_server_stops_cleanly(one_process):
    _, _, model_dir, daemon_address, folder = one_process
    short, _ = start_server(model_dir, daemon_address, folder / "short.log", "--timeout", "1")
    try:
        started = time.monotonic()
        response = httpx.post(f"{short.address}/v1/completions", timeout=120, json={
            "model": str(model_dir), "prompt": f"[{uuid.uuid4().hex}] Go on:", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True})
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "timeout"
        assert time.monotonic() - started < 30
    finally:
        status = short.terminate()
    assert status == 0, f"kvboost_server exited with {status} on SIGTERM:\n{short.log()}"
