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
