"""`python -m inference_service` start-up: the architecture is checked before any weight is read."""
from __future__ import annotations

import asyncio
import logging

from inference_service.__main__ import serve
from inference_service.serving.config import ServiceConfig


def test_an_unsupported_architecture_is_refused_with_its_reason(tmp_path, caplog) -> None:
    from transformers import GPT2Config

    # A config alone, no weights: the refusal must come before anything tries to load them.
    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    config = ServiceConfig(model=str(tmp_path), listen="127.0.0.1:0", cache_addr="", device="cpu")
    with caplog.at_level(logging.INFO):
        status = asyncio.run(asyncio.wait_for(serve(config), timeout=60))
    assert status == 2
    assert "GPT2LMHeadModel (gpt2) is not supported: learned absolute position embeddings" in caplog.text
    assert "--no-strict" in caplog.text


def test_the_fidelity_guard_is_the_flag_else_the_one_tuned_for_the_weights(caplog) -> None:
    from inference_service.config import EngineConfig, resolve_guard_threshold
    from inference_service.serving.config import service_engine_config
    from kvboost_common import catalogue

    def resolved(given: float | None, weights_id: str) -> float:
        return resolve_guard_threshold(EngineConfig(guard_threshold=given), weights_id).guard_threshold

    qwen15 = f"{catalogue.GGUF_FINGERPRINT}{catalogue.QWEN_CODER_15B.sha256}"
    assert service_engine_config().guard_threshold is None  # the service's default: chosen from the weights
    assert EngineConfig().guard_threshold == 0.0  # an engine built in code runs unguarded unless asked
    with caplog.at_level(logging.INFO):
        assert resolved(None, qwen15) == 7.894e-05
        assert resolved(0.0, qwen15) == 0.0  # 0 turns it off, whatever the weights
        assert resolved(None, "state-sha256:00") == catalogue.DEFAULT_GUARD_THRESHOLD
    assert "fidelity guard 7.894e-05 (tuned for qwen2.5-coder-1.5b" in caplog.text
    assert "fidelity guard 0 (as configured: --fidelity-guard)" in caplog.text
