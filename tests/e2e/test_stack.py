"""`make up`-like: client.stack starts the real daemon, and the service with the HTTP gateway in one process (or, with
--separate-gateway, as two), tiny model; clients of both use them, down stops them."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from client import CacheClient, KVBoostClient, cli
from client.healthcheck import check_health
from tests.e2e.stack_process import running_stack, save_tiny_model, stack_command

pytestmark = pytest.mark.e2e

# Byte-level tokenizer: one token per byte, so 600 bytes are 4 full chunks of 128 tokens.
SHARED_TEXT = "The harbour ferry leaves at six and returns at nine; bicycles cost extra. " * 8


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def test_up_serves_clients_is_idempotent_and_down_stops_everything(tmp_path, tiny_model_dir, capsys) -> None:
    run_dir = tmp_path / "run"
    with running_stack(run_dir, tiny_model_dir) as paths:
        assert {path.name for path in run_dir.iterdir()} >= {"daemon.pid", "server.pid", "daemon.log", "server.log",
                                                               "lmdb", "stack.json"}
        again = stack_command(paths, "up", "--model", str(tiny_model_dir))
        assert again.returncode == 0
        assert "cache daemon already running" in again.stdout
        assert "inference service and HTTP gateway already running" in again.stdout
        assert stack_command(paths, "status").returncode == 0
        models = httpx.get(f"http://{paths.gateway_address}/v1/models", timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == str(tiny_model_dir)

        with KVBoostClient(paths.address, timeout=120) as client:
            warmed = client.warm(SHARED_TEXT)
            assert (warmed.chunks_stored, warmed.chunk_size) == (len(SHARED_TEXT) // 128 + 1, 128)  # + partial tail
            result = client.generate(SHARED_TEXT + "When is the last ferry?", mode="prefix_cache",
                                     max_new_tokens=4).result
        assert result.cached_tokens == len(SHARED_TEXT) and not result.degraded
        assert result.kv_reuse_ratio == pytest.approx(result.cached_tokens / result.prompt_tokens)

        assert cli.main(["--address", paths.address, "generate", "hello", "--max-new-tokens", "2", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["generated_tokens"] == 2
        # Both requests write back their tail as a partial chunk, and their answer with the tail as another
        # (neither reaches a chunk boundary), in the background: wait for the four to land.
        entries = warmed.chunks_stored + 4
        deadline = time.monotonic() + 30
        with CacheClient(paths.daemon_address) as cache:
            while cache.stats().entries < entries and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cache.stats().entries == entries

        stopped = stack_command(paths, "down")
        assert stopped.returncode == 0
        assert stopped.stdout == "inference service and HTTP gateway: stopped\ncache daemon: stopped\n"
        assert not (run_dir / "daemon.pid").exists() and not (run_dir / "server.pid").exists()
        assert check_health(paths.address, timeout=0.5) == "UNREACHABLE"
        assert check_health(paths.daemon_address, timeout=0.5) == "UNREACHABLE"
        assert stack_command(paths, "status").returncode == 1

        # The LMDB folder under the run dir keeps the chunks across a restart.
        restarted = stack_command(paths, "up", "--model", str(tiny_model_dir))
        assert restarted.returncode == 0, restarted.stderr
        with CacheClient(paths.daemon_address) as cache:
            assert cache.stats().entries == entries


def test_separate_gateway_runs_three_processes(tmp_path, tiny_model_dir) -> None:
    run_dir = tmp_path / "run"
    with running_stack(run_dir, tiny_model_dir, "--separate-gateway") as paths:
        assert {path.name for path in run_dir.iterdir()} >= {"daemon.pid", "service.pid", "gateway.pid"}
        for name in ("daemon", "service", "gateway"):  # each set its startup heap aside from the collector
            assert "startup heap frozen" in (run_dir / f"{name}.log").read_text(), name
        assert not (run_dir / "server.pid").exists()
        assert stack_command(paths, "status").returncode == 0
        with KVBoostClient(paths.address, timeout=120) as client:
            assert client.generate("hello", max_new_tokens=2).result.generated_tokens == 2
        reply = httpx.post(f"http://{paths.gateway_address}/v1/completions", timeout=60,
                           json={"model": str(tiny_model_dir), "prompt": "hello", "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        other = stack_command(paths, "up", "--model", str(tiny_model_dir))  # the one-process layout: its ports are taken
        assert other.returncode == 1 and "already running" in other.stderr and "make down" in other.stderr, other.stderr
        assert not (run_dir / "server.pid").exists()
        (run_dir / "stack.json").unlink()  # as after an `up` that failed half way: down finds them by their pid files
        stopped = stack_command(paths, "down")
        assert stopped.stdout == ("HTTP gateway: stopped\ninference service: stopped\n"
                                  "inference service and HTTP gateway: not running\ncache daemon: stopped\n"), stopped.stdout
