"""bench/bench_peers.py's pure parts: reading each server's streamed reply and its usage/timings,
agreement, the llama-server command line, and the skip when llama.cpp cannot be built."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import bench_peers  # noqa: E402
from bench.peers import llama_cpp  # noqa: E402


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events) + b"data: [DONE]\n\n"


def streamed(events: bytes) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=events)))


def test_a_llama_server_reply_counts_its_own_evaluated_prompt_tokens():
    events = sse({"choices": [{"delta": {"content": "Hel"}}]}, {"choices": [{"delta": {"content": "lo"}}]},
                 {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 40,
                                           "prompt_tokens_details": {"cached_tokens": 30}},
                  "timings": {"prompt_n": 10, "cache_n": 30, "predicted_n": 2}})
    reply = bench_peers.Server("llama-server", "http://peer").chat([{"role": "user", "content": "x"}], 4, streamed(events))
    assert (reply.text, reply.prompt_tokens, reply.cached_tokens, reply.recomputed_tokens) == ("Hello", 40, 30, 10)
    assert reply.completion_tokens == 2 and reply.ttft_ms > 0


def test_our_reply_counts_prompt_minus_cached_tokens():
    events = sse({"choices": [{"delta": {"content": "A"}}]}, {"choices": [{"delta": {"content": "B"}}]},
                 {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 1164,
                                           "prompt_tokens_details": {"cached_tokens": 1149}}})
    reply = bench_peers.Server("ours", "http://ours").chat([{"role": "user", "content": "x"}], 4, streamed(events))
    assert reply.recomputed_tokens == 15 and reply.decode_tps > 0


def test_an_http_error_names_the_server():
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(404, content=b"no model")))
    with pytest.raises(RuntimeError, match="ours: HTTP 404"):
        bench_peers.Server("ours", "http://ours").chat([], 1, client)


def test_agreement_compares_first_answers_character_by_character():
    row = {"ours": {"first": {"text": "The fox"}}, "llama-server": {"first": {"text": "The dog"}}}
    same = {"ours": {"first": {"text": "Yes"}}, "llama-server": {"first": {"text": "Yes"}}}
    result = bench_peers.agreement({"rows": [row, same]})
    assert (result["same"], result["total"]) == (1, 2)
    assert result["prefix_chars"] == pytest.approx((4 + 3) / (7 + 3))


def test_the_server_command_states_threads_slots_and_context(tmp_path):
    command = llama_cpp.server_command(tmp_path, tmp_path / "m.gguf", 8080, threads=2, slots=16, context_per_slot=4608)
    joined = " ".join(command)
    assert "-t 2 -tb 2" in joined and "-np 16" in joined and f"-c {16 * 4608}" in joined and "-cb" in command


def test_the_peer_is_skipped_with_the_reason_when_it_cannot_be_built(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_PEERS_DIR", str(tmp_path))
    monkeypatch.setattr(llama_cpp.shutil, "which", lambda tool: None)
    with pytest.raises(llama_cpp.PeerUnavailable, match="needs cmake"):
        llama_cpp.build()
    server, why = bench_peers.start_peer(tmp_path, threads=2, slots=8, context_per_slot=4608)
    assert server is None and why.startswith("llama-server skipped: building llama.cpp needs cmake")
