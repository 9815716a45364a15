"""The `kvboost` CLI against in-process fake servicers: output, JSON field names, exit codes, error messages."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from client import cli
from kvboost.v1 import cache_pb2, inference_pb2
from tests.client_fakes import KEY_A, NAMESPACE, FakeCache, FakeInference, running_server
from tests.conftest import pick_free_port

RESULT_FIELDS = [field.name for field in inference_pb2.GenerationResult.DESCRIPTOR.fields]
WARM_FIELDS = [field.name for field in inference_pb2.WarmResult.DESCRIPTOR.fields]


@pytest.fixture()
def inference():
    return FakeInference()


@pytest.fixture()
def address(inference, monkeypatch):
    monkeypatch.delenv("KVBOOST_TOKEN", raising=False)
    monkeypatch.delenv("KVBOOST_AUTH_TOKEN_FILE", raising=False)
    with running_server(inference=inference) as address:
        yield address


@pytest.fixture()
def cache_fake():
    return FakeCache()


@pytest.fixture()
def daemon_address(cache_fake):
    with running_server(cache=cache_fake) as address:
        yield address


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- generate -----------------------------------------------------------------------------------

def test_generate_streams_text_and_prints_figures_on_stderr(capsys, address, inference) -> None:
    code, out, err = run(capsys, "--address", address, "generate", "Say hello", "--max-new-tokens", "2",
                         "--mode", "prefix_cache")
    assert code == 0
    assert out == "Hello world\n"
    assert err == ("[PREFIX_CACHE] prompt 8 tokens, cached 6 (reuse 0.75), recomputed 1; TTFT 12.5 ms; "
                   "2 tokens at 100.0 tok/s; total 20.0 ms; finish length\n")
    assert (inference.requests[0].max_new_tokens, inference.requests[0].mode) == (2, inference_pb2.PREFIX_CACHE)


def test_generate_json_prints_one_object_with_the_result_field_names(capsys, address) -> None:
    code, out, _ = run(capsys, "--address", address, "generate", "Say hello", "--json")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert list(result) == RESULT_FIELDS
    assert result["output_text"] == "Hello world" and result["mode"] == "PREFIX_CACHE"
    assert result["output_token_ids"] == [11, 12]


def test_generate_dash_reads_the_prompt_from_stdin(capsys, monkeypatch, address, inference) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\n"))
    assert run(capsys, "--address", address, "generate", "-")[0] == 0
    assert inference.requests[0].prompt == "from stdin\n"


def test_generate_chat_sends_system_and_user_messages(capsys, address, inference) -> None:
    code, _, _ = run(capsys, "--address", address, "generate", "Hi", "--chat", "--system", "Be brief.",
                     "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--seed", "1", "--stop", "\n")
    assert code == 0
    sent = inference.requests[0]
    assert [(m.role, m.content) for m in sent.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (round(sent.temperature, 3), round(sent.top_p, 3), sent.top_k, sent.seed, list(sent.stop)) == (
        0.7, 0.9, 5, 1, ["\n"])


def test_address_comes_from_the_environment(capsys, monkeypatch, address) -> None:
    monkeypatch.setenv("KVBOOST_ADDRESS", address)
    assert run(capsys, "generate", "hi", "--json")[0] == 0


def test_server_error_exits_1_with_the_code_and_message(capsys, address) -> None:
    code, out, err = run(capsys, "--address", address, "generate", "invalid")
    assert code == 1
    assert err.endswith(f"kvboost: error: Generate on {address} failed: INVALID_ARGUMENT: "
                        "prompt is empty after templating\n")


def test_unreachable_service_exits_1_and_names_the_address(capsys) -> None:
    address = f"127.0.0.1:{pick_free_port()}"
    code, out, err = run(capsys, "--address", address, "--timeout", "3", "stats")
    assert code == 1 and out == ""
    assert err.startswith(f"kvboost: error: cannot reach {address} (Stats): ")


def test_timeout_exits_1_and_says_so(capsys, address) -> None:
    code, _, err = run(capsys, "--address", address, "--timeout", "0.3", "generate", "slow")
    assert code == 1
    assert err.endswith(f"kvboost: error: Generate on {address} timed out after 0.3 s\n")


def test_usage_errors_exit_2(capsys, address) -> None:
    code, _, err = run(capsys, "--address", address, "generate", "hi", "--system", "x")
    assert (code, err) == (2, "kvboost: error: --system needs --chat\n")
    with pytest.raises(SystemExit) as caught:
        cli.main(["generate", "hi", "--mode", "fast"])
    assert caught.value.code == 2
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_token_file_is_read_and_sent(capsys, tmp_path, inference) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with running_server(inference=inference, token="s3cret") as address:
        assert run(capsys, "--address", address, "--token-file", str(token_file), "stats")[0] == 0
        code, _, err = run(capsys, "--address", address, "stats")
    assert code == 1 and "UNAUTHENTICATED: missing or wrong bearer token" in err
    assert inference.metadata[0]["authorization"] == "Bearer s3cret"


# --- warm, stats, info, verify ----------------------------------------------------------------------

def test_warm_reports_each_file_and_the_totals(capsys, tmp_path, address, inference) -> None:
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("one two three four five six")
    second.write_text("alpha beta gamma delta")
    code, out, _ = run(capsys, "--address", address, "warm", str(first), str(second), "--content-addressed")
    assert code == 0
    assert out.splitlines() == [
        f"{first}: 1 chunks stored, 6 tokens (chunk size 4, last 2 tokens as a partial chunk)",
        f"{second}: 1 chunks stored, 4 tokens (chunk size 4)",
        "warmed 2 file(s): 2 chunks, 10 tokens",
    ]
    assert [request.text for request in inference.requests] == [first.read_text(), second.read_text()]
    assert all(request.content_addressed for request in inference.requests)


def test_warm_json_prints_one_object_per_file(capsys, tmp_path, address) -> None:
    document = tmp_path / "doc.txt"
    document.write_text("one two three four")
    code, out, _ = run(capsys, "--address", address, "warm", str(document), "--json")
    assert code == 0
    result = json.loads(out)
    assert list(result) == ["file", *WARM_FIELDS]
    assert (result["file"], result["chunks_stored"], result["chunk_boundary_aligned"]) == (str(document), 1, True)


def test_warm_missing_file_exits_2_before_any_call(capsys, tmp_path, address, inference) -> None:
    present = tmp_path / "present.txt"
    present.write_text("text")
    code, _, err = run(capsys, "--address", address, "warm", str(present), str(tmp_path / "missing.txt"))
    assert code == 2
    assert err.startswith(f"kvboost: error: cannot read {tmp_path / 'missing.txt'}: ")
    assert inference.requests == []


def test_stats_json_and_text(capsys, address) -> None:
    code, out, _ = run(capsys, "--address", address, "stats", "--json")
    values = json.loads(out)
    assert code == 0
    assert list(values) == [field.name for field in inference_pb2.ServiceStatsReply.DESCRIPTOR.fields]
    assert values["prompt_tokens"] == 2**40  # 64-bit counters stay numbers
    _, out, _ = run(capsys, "--address", address, "stats")
    width = max(len(field.name) for field in inference_pb2.ServiceStatsReply.DESCRIPTOR.fields)  # names aligned
    assert f"{'requests':<{width}}  7" in out.splitlines()
    assert f"{'degraded':<{width}}  yes" in out.splitlines()


def test_info_json(capsys, address) -> None:
    code, out, _ = run(capsys, "--address", address, "info", "--json")
    assert code == 0 and json.loads(out)["default_recompute_strategy"] == "SELECTIVE"


def test_verify_exits_0_when_all_identical_else_1(capsys, address) -> None:
    code, out, _ = run(capsys, "--address", address, "verify")
    assert code == 0 and out.rstrip().endswith("2/2 prompts token-identical")
    code, out, _ = run(capsys, "--address", address, "verify", "same", "differs", "--json")
    report = json.loads(out)
    assert code == 1
    assert (report["identical"], report["total"]) == (1, 2)
    assert [check["token_identical"] for check in report["prompts"]] == [True, False]


# --- kvboost cache ---------------------------------------------------------------------------------

def test_cache_stats_goes_to_the_daemon_address(capsys, daemon_address) -> None:
    code, out, _ = run(capsys, "--daemon-address", daemon_address, "cache", "stats", "--json")
    values = json.loads(out)
    assert code == 0
    assert list(values) == [field.name for field in cache_pb2.CacheStatsReply.DESCRIPTOR.fields]
    assert values["namespaces"] == [{"namespace": "ab" * 32, "entries": 2, "bytes": 2048, "pinned": 1}]
    _, out, _ = run(capsys, "--daemon-address", daemon_address, "cache", "stats")
    assert f"{'ab' * 32}  2        2048   1" in out


def test_cache_delete_pin_unpin(capsys, daemon_address, cache_fake) -> None:
    code, out, _ = run(capsys, "--daemon-address", daemon_address, "cache", "delete", KEY_A.hex())
    assert (code, out) == (0, "deleted 1 entries, 1024 bytes freed\n")
    code, out, _ = run(capsys, "--daemon-address", daemon_address, "cache", "delete", "--namespace", NAMESPACE.hex())
    assert (code, cache_fake.requests[-1].namespace) == (0, NAMESPACE)
    unknown = "07" * 32
    code, out, _ = run(capsys, "--daemon-address", daemon_address, "cache", "pin", KEY_A.hex(), unknown)
    assert (code, out) == (0, f"pinned 1 key(s)\nmissing: {unknown}\n")
    code, out, _ = run(capsys, "--daemon-address", daemon_address, "cache", "unpin", KEY_A.hex(), "--json")
    assert (code, json.loads(out)) == (0, {"updated": 1, "missing": []})


def test_cache_errors(capsys, daemon_address) -> None:
    code, _, err = run(capsys, "--daemon-address", daemon_address, "cache", "pin", "07" * 32)
    assert (code, err) == (1, f"kvboost: error: Pin on {daemon_address} failed: NOT_FOUND: none of the keys exist\n")
    code, _, err = run(capsys, "--daemon-address", daemon_address, "cache", "pin", "abcd")
    assert (code, err) == (2, "kvboost: error: a key is 32 bytes (64 hex characters), got 2 bytes\n")


def test_console_entry_point_exit_code_in_a_real_process() -> None:
    address = f"127.0.0.1:{pick_free_port()}"
    completed = subprocess.run([sys.executable, "-m", "client.cli", "--address", address, "--timeout", "2", "stats"],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 1
    assert completed.stderr.startswith(f"kvboost: error: cannot reach {address} (Stats): ")


def test_cache_stats_text_shows_the_l2_tier_when_there_is_one() -> None:
    from client import cli_format
    from client.results import CacheStats

    plain = cli_format.cache_stats_text(CacheStats.from_proto(cache_pb2.CacheStatsReply(entries=1)))
    assert "L2 tier" not in plain
    tiered = cli_format.cache_stats_text(CacheStats.from_proto(cache_pb2.CacheStatsReply(
        entries=1, l2=cache_pb2.L2Stats(url="redis://127.0.0.1:6379", degraded=True, dropped_writes=4))))
    assert "L2 tier" in tiered and "redis://127.0.0.1:6379" in tiered
    assert any(line.split() == ["dropped_writes", "4"] for line in tiered.splitlines())
