"""bench/ttft_stages.py (bench_gpu.py's split of a request's time) on the tiny random model on a CPU."""
from __future__ import annotations

import pytest
import torch

from bench.gpu_model import random_model, word_tokenizer, words
from bench.ttft_stages import DEVICE_STAGES, HOST_STAGES, format_row, median_row, split_request
from inference_service.engine.engine import Engine, EngineConfig
from inference_service.store.memory import InMemoryStore


def test_a_request_is_split_into_its_stages_cached_or_not():
    model = random_model("tiny", "cpu", torch.float32, 512)
    engine = Engine(model, word_tokenizer(model.config.vocab_size), EngineConfig(chunk_size=16), InMemoryStore(),
                    model_id="random-tiny", weights_id="test-ttft-stages")
    try:
        document = words(100, seed=1, vocab_size=model.config.vocab_size)
        cold = split_request(engine, document + " w7 w8", "baseline")
        cached = split_request(engine, document + " w9 w10")  # the baseline request stored nothing: this one does
        again = split_request(engine, document + " w11 w12")
        assert (cold["cached_tokens"], cold["lookup"], cold["placement"]) == (0, 0.0, 0.0)
        assert cached["cached_tokens"] == 0 and again["cached_tokens"] == 100  # the document, to its last token
        for row in (cold, again):
            assert all(row[name] >= 0 for name in (*HOST_STAGES, *DEVICE_STAGES))
            assert row["question prefill gpu"] is None  # no CUDA events on a CPU
            assert row["rest"] == pytest.approx(row["ttft_ms"] - sum(row[name] for name in (*HOST_STAGES,
                                                                                              *DEVICE_STAGES)))
        assert again["lookup"] > 0
        median = median_row([cold, again, again])
        assert median["cached_tokens"] == 100 and median["first sample gpu"] is None
        assert format_row("from L0", median).startswith("  from L0        TTFT")
    finally:
        engine.close()
