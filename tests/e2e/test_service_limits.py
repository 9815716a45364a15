"""A real service process against a daemon that requires a token: the service presents its
--cache-auth-token-file token (without it, it runs degraded), and --max-new-tokens / --max-prompt-tokens refuse
larger requests with INVALID_ARGUMENT."""
from __future__ import annotations

import grpc
import pytest
from kvboost.v1 import cache_pb2, cache_pb2_grpc
from kvboost.v1 import inference_pb2 as pb

from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.e2e.service_process import generate, running_service
from tests.e2e.stack_process import save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TOKEN = "daemon-s3cret"
CHUNK_SIZE = 16
MAX_NEW_TOKENS = 4
MAX_PROMPT_TOKENS = 64
TEXT = "Ferry notes: gate two, six sharp. " * 2  # byte tokenizer: one token per character, 68 tokens


def daemon_entries(daemon_addr: str) -> int:
    with grpc.insecure_channel(daemon_addr) as channel:
        stats = cache_pb2_grpc.CacheServiceStub(channel).Stats(
            cache_pb2.CacheStatsRequest(), timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")])
    return stats.entries


def test_the_service_presents_its_token_and_enforces_its_limits(tmp_path) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    daemon_port = pick_free_port()
    daemon_addr = f"127.0.0.1:{daemon_port}"
    daemon = start_daemon(tmp_path / "lmdb", daemon_port, "--auth-token-file", str(token_file))
    limits = ("--chunk-size", str(CHUNK_SIZE), "--max-new-tokens", str(MAX_NEW_TOKENS),
              "--max-prompt-tokens", str(MAX_PROMPT_TOKENS))
    try:
        # Without the token the daemon refuses the service, which then serves degraded (no cache).
        with running_service(str(model_dir), daemon_addr, pick_free_port(), tmp_path / "no-token.log",
                             *limits) as service, service.stub() as stub:
            _, result = generate(stub, TEXT[:40], max_new_tokens=1, mode=pb.PREFIX_CACHE)
            assert result.degraded and result.cached_tokens == 0
        assert daemon_entries(daemon_addr) == 0

        with running_service(str(model_dir), daemon_addr, pick_free_port(), tmp_path / "token.log", *limits,
                             "--cache-auth-token-file", str(token_file)) as service, service.stub() as stub:
            # With it: Warm stores its chunks in the daemon, and a later request reuses them.
            warmed = stub.Warm(pb.WarmRequest(text=TEXT[:48]), timeout=60)
            assert warmed.chunks_stored == 48 // CHUNK_SIZE
            assert daemon_entries(daemon_addr) == warmed.chunks_stored
            _, result = generate(stub, TEXT[:60], max_new_tokens=MAX_NEW_TOKENS, mode=pb.PREFIX_CACHE)
            assert not result.degraded and result.cached_tokens == 48
            assert result.generated_tokens <= MAX_NEW_TOKENS

            # The limits: over either one is INVALID_ARGUMENT naming the limit.
            for prompt, max_new_tokens, limit in ((TEXT[:60], MAX_NEW_TOKENS + 1, f"limit {MAX_NEW_TOKENS}"),
                                                  (TEXT, 1, f"at most {MAX_PROMPT_TOKENS}")):
                with pytest.raises(grpc.RpcError) as raised:
                    generate(stub, prompt, max_new_tokens=max_new_tokens)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
                assert limit in raised.value.details()
    finally:
        daemon.terminate()
