"""The promise on the real SmolLM2 through a running cache daemon: at least 200 generated repetitive prompts (words,
log lines, CSV rows, documents repeated inside a prompt and across prompts, prefixes of each other, unicode), asked
in generated orders in the default mode, each answered as plain `model.generate` answers it and never approximate.

Hypothesis draws the workloads first (derandomized: the same ones every run), and every distinct prompt's reference
goes to the reference process at once. The workloads then run on two engines over the one daemon, two workloads at
a time on each, every workload in a thread of its own asking its prompts one after another in its generated order.
A workload's cache salt keeps its chunks apart from every other's, so what it proves (a prompt asked again is cached
to its last token; what it shares with an earlier prompt of the workload is reused) does not depend on the
others. Running them side by side puts two workloads' rows in one engine's decode steps, as concurrent requests
are served (the default path; `test_identity.py`'s continuous-batching test holds it to `model.generate` too), and
keeps both cores busy: the engines' step loops and the reference process each run one torch thread, so every
product is computed as the reference computes it."""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions
from tests.conftest import pick_free_port
from tests.e2e.daemon_process import start_daemon
from tests.repetitive_prompts import Workload, workloads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.usefixtures("one_torch_thread")]

MAX_NEW_TOKENS = 8
CHUNK_SIZE = 16  # many chunk boundaries in prompts of a few hundred tokens
MIN_PROMPTS = 200
WORKLOADS = 60
ENGINES = 2
WORKLOADS_PER_ENGINE = 2
_salts = itertools.count()


@pytest.fixture()
def engines(smollm2, tmp_path):
    """ENGINES engines in the default mode, each with its own store client, over one cache daemon."""
    model, tokenizer, path = smollm2
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port())
    stores = [GrpcChunkStore(GrpcStoreOptions(address=daemon.address)) for _ in range(ENGINES)]
    running = [Engine(model, tokenizer, EngineConfig(chunk_size=CHUNK_SIZE), store, model_id=path) for store in stores]
    try:
        yield running
    finally:
        for engine in running:
            engine.close()
        for store in stores:
            store.close()
        daemon.terminate()


def drawn_workloads() -> list[Workload]:
    drawn: list[Workload] = []

    @settings(max_examples=WORKLOADS, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(workload=workloads(max_chars=900))
    def draw(workload: Workload) -> None:
        drawn.append(workload)

    draw()
    return drawn


def test_default_mode_is_model_generate_on_200_generated_prompts(smollm2, smollm2_reference, engines):
    _, tokenizer, _ = smollm2
    drawn = drawn_workloads()
    references: dict[str, Future] = {}  # plain model.generate's tokens per distinct prompt, computed meanwhile
    for workload in drawn:
        for prompt in workload.prompts:
            if prompt not in references:
                references[prompt] = smollm2_reference.submit(tokenizer(prompt)["input_ids"], MAX_NEW_TOKENS)
    engine_of_thread: dict[str, Engine] = {}

    def take_an_engine() -> None:  # each pool thread keeps one engine: WORKLOADS_PER_ENGINE threads per engine
        engine_of_thread[threading.current_thread().name] = engines[len(engine_of_thread) % ENGINES]

    def run(workload: Workload) -> tuple[list[tuple[str, list[int]]], tuple[str, list[int]]]:
        """(prompt, default mode's tokens) per ask in the workload's order; (last prompt, baseline mode's tokens)."""
        engine = engine_of_thread[threading.current_thread().name]
        salt = f"sweep-{next(_salts)}"

        def ask(prompt: str, mode: str | None = None):
            outcome = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, cache_salt=salt,
                                                       mode=mode))
            engine.flush_writes()
            return outcome

        answers, seen = [], set()
        for prompt in workload.asked():
            outcome = ask(prompt)
            assert outcome.mode == "prefix_cache" and not outcome.approximate
            answers.append((prompt, list(outcome.output_token_ids)))
            if prompt in seen:  # asked again: cached to its last token
                assert outcome.cached_tokens == outcome.prompt_tokens - 1, prompt
            seen.add(prompt)
        baseline = ask(workload.prompts[-1], mode="baseline")
        return answers, (workload.prompts[-1], list(baseline.output_token_ids))

    with ThreadPoolExecutor(ENGINES * WORKLOADS_PER_ENGINE, thread_name_prefix="workload",
                            initializer=take_an_engine) as pool:
        runs = list(pool.map(run, drawn))
    answers = [answer for workload_answers, _ in runs for answer in workload_answers]
    baselines = [baseline for _, baseline in runs]
    assert len(answers) >= MIN_PROMPTS, f"only {len(answers)} prompts were asked"
    differing = [prompt for prompt, tokens in answers if tokens != references[prompt].result()]
    assert differing == [], f"{len(differing)} of {len(answers)} answers differ from model.generate: {differing[:3]!r}"
    differing_baselines = [prompt for prompt, tokens in baselines if tokens != references[prompt].result()]
    assert differing_baselines == [], f"baseline mode differs from model.generate: {differing_baselines[:3]!r}"
    assert sum(engine.stats()["approximate_answers"] for engine in engines) == 0
