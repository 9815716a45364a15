"""Real daemon and service processes with the real SmolLM2: a warmed system prompt is reused, across restarts too."""
from __future__ import annotations

import pytest
import torch

from kvboost_keys.prompts import tokenize_prompt

from inference_service.model.weights import DEFAULT_MODEL
from kvboost.v1 import inference_pb2 as pb
from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.e2e.service_process import generate, running_service
from tests.e2e.stack_process import save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CHUNK_SIZE = 128
_ROUTES = ["north pier", "old town", "lighthouse", "fish market", "island camp", "university", "airport dock", "west marina"]
# About 1510 SmolLM2 tokens: 11 full chunks, so a short question after it reuses > 0.9 of the prompt.
SYSTEM_PROMPT = "\n".join(
    ["You are the help desk of the Harbour Town ferry service. Answer in one short sentence."]
    + [f"Rule {i + 1}: the ferry to the {_ROUTES[i % len(_ROUTES)]} leaves at {6 + i % 12}:{(i * 7) % 60:02d} "
       f"from gate {i % 9 + 1}; bicycles cost {2 + i % 5} euros and dogs travel free on weekdays."
       for i in range(40)]
)
QUESTION = "\nQuestion: when does the ferry to the lighthouse leave?\nAnswer:"


def plain_generate(smollm2, prompt: str, max_new_tokens: int) -> list[int]:
    """Plain transformers greedy generation in this process, the same weights the service loads."""
    model, tokenizer, _ = smollm2
    token_ids = tokenize_prompt(tokenizer, prompt)[0]
    input_ids = torch.tensor([token_ids])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens)
    return output[0, len(token_ids):].tolist()


@pytest.mark.slow
def test_warmed_system_prompt_is_reused_and_survives_restarts(tmp_path, smollm2) -> None:
    daemon_port, service_port = pick_free_port(), pick_free_port()
    daemon_addr = f"127.0.0.1:{daemon_port}"

    def service(log_name: str):
        return running_service(DEFAULT_MODEL, daemon_addr, service_port, tmp_path / log_name)

    daemon = start_daemon(tmp_path / "lmdb", daemon_port)
    try:
        with service("service-1.log") as first_service, first_service.stub() as stub:
            warmed = stub.Warm(pb.WarmRequest(text=SYSTEM_PROMPT), timeout=120)
            assert warmed.chunk_size == CHUNK_SIZE
            # Whole chunks and the tail as a partial chunk.
            assert warmed.chunks_stored == warmed.token_count // CHUNK_SIZE + 1 >= 12
            _, reused = generate(stub, SYSTEM_PROMPT + QUESTION, max_new_tokens=8, mode=pb.PREFIX_CACHE)
        # The question continues the prompt token for token (SmolLM2 splits at the newline): all of it is reused.
        assert reused.cached_tokens == warmed.token_count
        assert reused.kv_reuse_ratio > 0.9
        assert not reused.degraded

        # Both processes restart (the daemon gracefully, on the same data): the first request still hits.
        assert daemon.terminate() == 0
        daemon = start_daemon(tmp_path / "lmdb", daemon_port)
        with service("service-2.log") as second_service, second_service.stub() as stub:
            _, after_restart = generate(stub, SYSTEM_PROMPT + QUESTION, max_new_tokens=8, mode=pb.PREFIX_CACHE)
        # The first request's write-back (its own tail, question included) survived both restarts too.
        assert after_restart.cached_tokens == reused.prompt_tokens - 1
        assert after_restart.kv_reuse_ratio > 0.9
        # Both answers, from cached K/V, are what plain transformers generates for the whole prompt.
        assert list(reused.output_token_ids) == plain_generate(smollm2, SYSTEM_PROMPT + QUESTION, 8)
        assert list(after_restart.output_token_ids) == list(reused.output_token_ids)
    finally:
        if daemon.process.poll() is None:
            daemon.terminate()


def test_write_backs_reach_the_daemon_through_a_sigterm(tmp_path) -> None:
    """No Warm: the first request's chunks are written back in the background; SIGTERM right after it
    still delivers them, so a fresh service process hits them."""
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    daemon_port = pick_free_port()
    daemon = start_daemon(tmp_path / "lmdb", daemon_port)
    prompt = "Ferries leave the north pier every hour; the last one returns at nine. " * 4
    try:
        for run, log_name in enumerate(["service-1.log", "service-2.log"]):
            with running_service(str(model_dir), f"127.0.0.1:{daemon_port}", pick_free_port(), tmp_path / log_name,
                                 "--chunk-size", "32") as service, service.stub() as stub:
                _, result = generate(stub, prompt, max_new_tokens=2, mode=pb.PREFIX_CACHE)
            # Byte-level tokenizer: the second process reuses every full chunk the first one computed.
            # The first process wrote back its whole chunks and its tail: the second reuses all but the last token.
            assert result.cached_tokens == (0 if run == 0 else len(prompt) - 1)
    finally:
        daemon.terminate()
