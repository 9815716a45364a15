"""client/examples/demo.py against a fake service: the table, the stop hint, the reuse check."""
from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvboost.v1 import inference_pb2
from tests.client_fakes import FakeInference, make_result, running_server

DEMO_PATH = Path(__file__).resolve().parents[2] / "client" / "examples" / "demo.py"


def load_demo():
    spec = importlib.util.spec_from_file_location("kvboost_demo", DEMO_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ReusingInference(FakeInference):
    """Answers BASELINE with no reuse and cached modes with `reuse`; a request that names no mode runs in the
    service's default, PREFIX_CACHE."""

    def __init__(self, reuse: float) -> None:
        super().__init__()
        self.reuse = reuse

    def Generate(self, request, context):
        self._record(request, context)
        cached = request.mode != inference_pb2.BASELINE
        yield inference_pb2.GenerateEvent(text="Paris", token_ids=[1])
        yield inference_pb2.GenerateEvent(result=make_result(
            output_text="Paris", mode=request.mode or inference_pb2.PREFIX_CACHE, prompt_tokens=1000, cached_tokens=int(self.reuse * 1000) * cached,
            kv_reuse_ratio=self.reuse * cached, ttft_ms=20.0 if cached else 400.0))


def test_demo_warms_asks_and_prints_the_table(capsys) -> None:
    demo = load_demo()
    inference = ReusingInference(reuse=0.95)
    with running_server(inference=inference) as address:
        assert demo.main(["--address", address, "--max-new-tokens", "8", "--no-gateway"]) == 0
    out = capsys.readouterr().out
    warm = inference.requests[1]
    assert [message.role for message in warm.messages] == ["system"]
    assert "Lanterna Bay Ferry Company" in warm.messages[0].content
    asked = [request for request in inference.requests if isinstance(request, inference_pb2.GenerateRequest)]
    assert len(asked) == len(demo.QUESTIONS) + 1
    assert all(request.messages[0] == warm.messages[0] for request in asked)  # the shared prefix
    assert "#  mode          question" in out
    assert all(request.mode == inference_pb2.MODE_UNSPECIFIED for request in asked[1:])  # the default: exact
    assert "question 1 with the cache gives baseline's answer token for token: yes" in out
    assert "baseline TTFT 400.0 ms, with the cache 20.0 ms on average (20.0x faster)" in out
    assert "stop it with `make down`" in out


def test_demo_fails_when_follow_ups_reuse_too_little(capsys) -> None:
    demo = load_demo()
    with running_server(inference=ReusingInference(reuse=0.5)) as address:
        assert demo.main(["--address", address, "--no-gateway"]) == 1
    assert "follow-up question(s) reused 80% of the prompt or less" in capsys.readouterr().err


def test_demo_says_how_to_start_the_stack_when_it_is_down(capsys) -> None:
    from tests.conftest import pick_free_port

    demo = load_demo()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo.KVBoostClient, "wait_ready", lambda self, timeout: self._rpc.wait_ready(0.2))
        assert demo.main(["--address", f"127.0.0.1:{pick_free_port()}", "--no-gateway"]) == 1
    assert "Is the stack running? Start it with `make up`." in capsys.readouterr().err


class _FakeGateway(BaseHTTPRequestHandler):
    """Answers POST /v1/chat/completions as the gateway would, and keeps the body it got."""

    bodies: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        _FakeGateway.bodies.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
        reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Yes, on the Aurora."}}],
                            "usage": {"prompt_tokens": 1000, "completion_tokens": 5, "total_tokens": 1005,
                                      "prompt_tokens_details": {"cached_tokens": 896}},
                            "kvboost": {"approximate": False, "approximate_tokens": 0}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_demo_asks_the_last_question_through_the_http_gateway(capsys) -> None:
    demo = load_demo()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeGateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with running_server(inference=ReusingInference(reuse=0.95)) as address:
            gateway_url = f"http://127.0.0.1:{server.server_port}/v1"
            assert demo.main(["--address", address, "--gateway-url", gateway_url]) == 0
    finally:
        server.shutdown()
        thread.join()
    path, body = _FakeGateway.bodies[-1]
    assert path == "/v1/chat/completions" and body["messages"][-1]["content"] == demo.QUESTIONS[-1]
    assert body["messages"][0]["content"].startswith("You are the customer assistant")
    out = capsys.readouterr().out
    assert "1000 prompt tokens, 896 cached (prompt_tokens_details.cached_tokens), 5 generated, approximate: false" in out
    assert "kvboost" not in body  # the gateway's default mode: exact
    assert "Yes, on the Aurora." in out
