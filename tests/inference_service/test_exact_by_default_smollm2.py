"""The promise on the real SmolLM2 through a running cache daemon: at least 200 generated repetitive prompts (words,
log lines, CSV rows, documents repeated inside a prompt and across prompts, prefixes of each other, unicode), asked
in generated orders in the default mode, each answered as plain `model.generate` answers it and never approximate."""
from __future__ import annotations

import itertools
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings

from inference_service.engine.engine import EngineConfig, GenerationParams
from tests.inference_service.daemon_engine import engine_over_daemon
from tests.repetitive_prompts import Workload, workloads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.usefixtures("one_torch_thread")]

MAX_NEW_TOKENS = 8
CHUNK_SIZE = 16  # many chunk boundaries in prompts of a few hundred tokens
MIN_PROMPTS = 200
_salts = itertools.count()


@pytest.fixture()
def engine(smollm2, tmp_path):
    with engine_over_daemon(smollm2, tmp_path / "lmdb", EngineConfig(chunk_size=CHUNK_SIZE)) as engine:  # default mode
        yield engine


def test_default_mode_is_model_generate_on_200_generated_prompts(smollm2, smollm2_reference, engine):
    _, tokenizer, _ = smollm2
    references: dict[str, Future] = {}

    def expected(prompt: str) -> Future:
        """Plain model.generate's tokens for `prompt`, computed in the reference process while the engine runs
        (asked once per distinct prompt)."""
        if prompt not in references:
            references[prompt] = smollm2_reference.submit(tokenizer(prompt)["input_ids"], MAX_NEW_TOKENS)
        return references[prompt]

    def ask(prompt: str, salt: str, mode: str | None = None):
        outcome = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, cache_salt=salt,
                                                   mode=mode))
        engine.flush_writes()
        return outcome

    asked: list[str] = []
    answers: list[tuple[str, list[int]]] = []  # (prompt, default mode's tokens): compared once all references are in
    baselines: list[tuple[str, list[int]]] = []  # (last prompt, baseline mode's tokens), one per workload

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(workload=workloads(max_chars=900))
    def sweep(workload: Workload) -> None:
        salt = f"sweep-{next(_salts)}"
        for prompt in workload.prompts:
            expected(prompt)
        seen: set[str] = set()
        for prompt in workload.asked():
            outcome = ask(prompt, salt)
            assert outcome.mode == "prefix_cache" and not outcome.approximate
            answers.append((prompt, list(outcome.output_token_ids)))
            if prompt in seen:  # asked again: cached to its last token
                assert outcome.cached_tokens == outcome.prompt_tokens - 1, prompt
            seen.add(prompt)
            asked.append(prompt)
        baseline = ask(workload.prompts[-1], salt, mode="baseline")
        baselines.append((workload.prompts[-1], list(baseline.output_token_ids)))

    sweep()
    assert len(asked) >= MIN_PROMPTS, f"only {len(asked)} prompts were asked"
    differing = [prompt for prompt, tokens in answers if tokens != expected(prompt).result()]
    assert differing == [], f"{len(differing)} of {len(asked)} answers differ from model.generate: {differing[:3]!r}"
    differing_baselines = [prompt for prompt, tokens in baselines if tokens != expected(prompt).result()]
    assert differing_baselines == [], f"baseline mode differs from model.generate: {differing_baselines[:3]!r}"
    assert engine.stats()["approximate_answers"] == 0
