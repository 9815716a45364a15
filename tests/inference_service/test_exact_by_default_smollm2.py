"""The promise on the real SmolLM2 through a running cache daemon: at least 200 generated repetitive prompts (words,
log lines, CSV rows, documents repeated inside a prompt and across prompts, prefixes of each other, unicode), asked
in generated orders in the default mode, each answered as plain `model.generate` answers it and never approximate."""
from __future__ import annotations

import itertools
from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from inference_service.engine.engine import EngineConfig, GenerationParams
from tests.inference_service.daemon_engine import engine_over_daemon
from tests.repetitive_prompts import Workload, workloads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_NEW_TOKENS = 8
CHUNK_SIZE = 16  # many chunk boundaries in prompts of a few hundred tokens
MIN_PROMPTS = 200
_salts = itertools.count()


@pytest.fixture()
def engine(smollm2, tmp_path):
    with engine_over_daemon(smollm2, tmp_path / "lmdb", EngineConfig(chunk_size=CHUNK_SIZE)) as engine:  # default mode
        yield engine


def test_default_mode_is_model_generate_on_200_generated_prompts(smollm2, engine):
    model, tokenizer, _ = smollm2

    @lru_cache(maxsize=None)
    def expected(prompt: str) -> list[int]:
        ids = tokenizer(prompt)["input_ids"]
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                    max_new_tokens=MAX_NEW_TOKENS)
        return output[0, len(ids):].tolist()

    def ask(prompt: str, salt: str, mode: str | None = None):
        outcome = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, cache_salt=salt,
                                                   mode=mode))
        engine.flush_writes()
        return outcome

    asked: list[str] = []
    differing: list[str] = []

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(workload=workloads(max_chars=900))
    def sweep(workload: Workload) -> None:
        salt = f"sweep-{next(_salts)}"
        seen: set[str] = set()
        for prompt in workload.asked():
            outcome = ask(prompt, salt)
            assert outcome.mode == "prefix_cache" and not outcome.approximate
            if outcome.output_token_ids != expected(prompt):
                differing.append(prompt)
            if prompt in seen:  # asked again: cached to its last token
                assert outcome.cached_tokens == outcome.prompt_tokens - 1, prompt
            seen.add(prompt)
            asked.append(prompt)
        baseline = ask(workload.prompts[-1], salt, mode="baseline")
        assert baseline.output_token_ids == expected(workload.prompts[-1])

    sweep()
    assert len(asked) >= MIN_PROMPTS, f"only {len(asked)} prompts were asked"
    assert differing == [], f"{len(differing)} of {len(asked)} answers differ from model.generate: {differing[:3]!r}"
    assert engine.stats()["approximate_answers"] == 0
