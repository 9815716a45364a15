"""One request's fault is its own: faults injected into one row after admission, at every stage, end that request
alone with a clear error; every other request finishes token-identical to plain `model.generate`, and every
slot comes back."""
from __future__ import annotations

import threading

import pytest
import torch

from inference_service.reuse import assembler as assembler_module
from inference_service.engine import prefill as prefill_module
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.engine_parts.generation import NonFiniteLogits, RowDecoder
from inference_service.errors import InvalidRequest
from inference_service.model.detokenizer import IncrementalDetokenizer
from inference_service.model.step_runner import StepRunner
from kvboost_keys.prompts import tokenize_prompt
from inference_service.store.memory import InMemoryStore
from tests.conftest import wait_for
from tests.inference_service.engine.test_engine import reference_ids, text_of_length

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 12
OTHERS = [text_of_length(30), "A different question about paint?", text_of_length(61) + " and more"]
# Shares no first token with the others: with reuse inside a chunk, a prompt that did could use the victim's
# stored chunks, and a fault injected into reading them would no longer be the victim's alone.
VICTIM = "Victim's own prompt, which a fault will hit. " * 2


class Run:
    """The victim and three others submitted together; each one's on_done result or error, by name."""

    def __init__(self, engine: Engine, victim: GenerationParams | None = None) -> None:
        self.engine, self.results, self.victim_events = engine, {}, []
        self._done = threading.Event()
        requests = {f"other{i}": GenerationParams(prompt=p, max_new_tokens=MAX_NEW_TOKENS, request_id=f"other{i}")
                    for i, p in enumerate(OTHERS)}
        requests["victim"] = victim or GenerationParams(prompt=VICTIM, max_new_tokens=MAX_NEW_TOKENS,
                                                        request_id="victim")
        self.victim_on_token = self.victim_events.append
        for name, params in requests.items():
            engine.submit(params, self.victim_on_token if name == "victim" else None, lambda: False,
                          lambda result, error, name=name: self._report(name, result, error))

    def _report(self, name, result, error) -> None:
        self.results[name] = error if error is not None else result
        if len(self.results) == 4:
            self._done.set()

    def wait(self) -> dict:
        assert self._done.wait(60), f"only {sorted(self.results)} reported: a request hangs"
        self.engine.flush_writes()
        wait_for(lambda: self.engine.core.owner.ledger.bytes_in_use == 0 or self.engine.core.owner.collect(),
                 what="every slot to come back")
        return self.results


@pytest.fixture()
def engine(tiny_llama):
    model, tokenizer = tiny_llama
    # l0_bytes=0: every hit is read from the store, whose blobs these tests break (L0 keeps its own copies).
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, max_prefill_tokens=32, max_forward_tokens=16,
                                                   l0_bytes=0), InMemoryStore(), model_id="tiny")
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def references(tiny_llama) -> dict[str, list[int]]:
    model, tokenizer = tiny_llama
    return {f"other{i}": reference_ids(model, tokenize_prompt(tokenizer, p)[0], MAX_NEW_TOKENS)
            for i, p in enumerate(OTHERS)}


def assert_others_identical(results: dict, references: dict) -> None:
    for name, expected in references.items():
        assert not isinstance(results[name], BaseException), f"{name} failed: {results[name]!r}"
        assert results[name][0].output_token_ids == expected, name


def fault_in_take(monkeypatch, run_holder: list, at_token: int, error: Exception) -> None:
    """The victim's row raises `error` when it picks token number `at_token` (0: the first, at its join)."""
    take = RowDecoder.take

    def faulty(self, logits, hint=None):
        if run_holder and self.on_token is run_holder[0].victim_on_token and len(self.token_ids) == at_token:
            raise error
        return take(self, logits, hint)

    monkeypatch.setattr(RowDecoder, "take", faulty)


@pytest.mark.parametrize("at_token", [0, 5], ids=["at-join", "mid-decode"])
def test_the_sampler_raising_ends_that_request_alone(engine, references, monkeypatch, at_token):
    holder: list = []
    fault_in_take(monkeypatch, holder, at_token, RuntimeError("sampler exploded"))
    holder.append(run := Run(engine))
    results = run.wait()
    assert isinstance(results["victim"], RuntimeError) and "sampler exploded" in str(results["victim"])
    assert_others_identical(results, references)


def test_the_stop_handler_raising_ends_that_request_alone(engine, references, monkeypatch):
    add, calls = IncrementalDetokenizer.add, {}

    def faulty(self, token_id):
        if "ZZZ" in self._stop:  # the victim's: breaks on its third token, mid-decode
            calls[id(self)] = calls.get(id(self), 0) + 1
            if calls[id(self)] == 3:
                raise ValueError("stop handler broke")
        return add(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add", faulty)
    victim = GenerationParams(prompt=VICTIM, max_new_tokens=MAX_NEW_TOKENS, stop=("ZZZ",), request_id="victim")
    results = Run(engine, victim).wait()
    assert isinstance(results["victim"], ValueError)
    assert_others_identical(results, references)


def test_nan_logits_in_the_batched_decode_end_that_row_alone(engine, references, monkeypatch):
    decode, calls = StepRunner.decode, []

    def poisoned(self, rows):
        logits = decode(self, rows)
        victim = [seq for seq in engine.core.executor.sequences.values() if seq.request_id == "victim"]
        if victim and victim[0].rows and len(victim[0].rows[0].decoder.token_ids) >= 2 and not calls:
            calls.append(1)  # once, a few tokens into its decode
            order = list(rows)
            logits[order.index(victim[0].rows[0].slot)] = float("nan")
        return logits

    monkeypatch.setattr(StepRunner, "decode", poisoned)
    results = Run(engine).wait()
    assert isinstance(results["victim"], NonFiniteLogits)
    assert_others_identical(results, references)


# The first token greedy (from step_hints' copy), sampled, or with its EOS held off (both read the logits themselves).
@pytest.mark.parametrize("victim_fields", [{}, {"temperature": 0.8, "seed": 3}, {"min_tokens": 2}],
                         ids=["greedy", "sampled", "min-tokens"])
def test_nan_logits_at_the_end_of_a_prefill_end_that_request_alone(engine, references, monkeypatch, victim_fields):
    finish = prefill_module.finish

    def poisoned(seq, buffers, first_logits):
        if seq.request_id == "victim" and first_logits is not None:
            first_logits = torch.full_like(first_logits, float("nan"))
        finish(seq, buffers, first_logits)

    monkeypatch.setattr(prefill_module, "finish", poisoned)
    victim = GenerationParams(prompt=VICTIM, max_new_tokens=MAX_NEW_TOKENS, request_id="victim", **victim_fields)
    results = Run(engine, victim).wait()
    assert isinstance(results["victim"], NonFiniteLogits)
    assert_others_identical(results, references)


def test_a_prefill_piece_failing_ends_that_request_alone(engine, references, monkeypatch):
    run_piece = prefill_module.run_piece

    def faulty(seq, buffers, num_tokens):
        if seq.request_id == "victim":
            raise RuntimeError("piece failed")
        return run_piece(seq, buffers, num_tokens)

    monkeypatch.setattr(prefill_module, "run_piece", faulty)
    victim = GenerationParams(prompt=text_of_length(200), max_new_tokens=MAX_NEW_TOKENS, request_id="victim")
    results = Run(engine, victim).wait()  # 200 tokens > max_forward_tokens: the victim prefills in pieces
    assert isinstance(results["victim"], RuntimeError)
    assert_others_identical(results, references)


def test_a_corrupt_blob_of_that_request_is_its_fault_alone(engine, references, monkeypatch):
    engine.warm(VICTIM)  # the victim's chunks are in the store; reading them fails
    raw_header = assembler_module._raw_header  # the first look at each fetched blob
    victim_keys = set(engine.plan_request(GenerationParams(prompt=VICTIM))[1].prefix_keys)

    def corrupt(expected_key, *args, **kwargs):
        if expected_key in victim_keys:
            raise ValueError("blob header is garbage")
        return raw_header(expected_key, *args, **kwargs)

    monkeypatch.setattr(assembler_module, "_raw_header", corrupt)
    results = Run(engine).wait()
    assert isinstance(results["victim"], ValueError)
    assert_others_identical(results, references)


def test_a_write_back_error_leaves_every_request_whole(engine, references, monkeypatch):
    store_now = engine.parts.writeback.store_now

    def failing(pending):
        if pending.request_id == "victim":
            raise OSError("disk full")
        return store_now(pending)

    monkeypatch.setattr(engine.parts.writeback, "store_now", failing)
    results = Run(engine).wait()  # the write-back runs after the first token: the victim's answer stands
    model, tokenizer = engine.model, engine.tokenizer
    assert results["victim"][0].output_token_ids == reference_ids(model, tokenize_prompt(tokenizer, VICTIM)[0],
                                                                   MAX_NEW_TOKENS)
    assert_others_identical(results, references)


def test_a_temperature_that_overflows_is_invalid_argument_for_that_request_alone(engine, references):
    victim = GenerationParams(prompt=VICTIM, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=1,
                              request_id="victim")
    # Validation refuses it now (below MIN_TEMPERATURE); as if it had got past validation, the sampler's own
    # check on the host still makes it this request's INVALID_ARGUMENT alone.
    object.__setattr__(victim, "temperature", 1e-45)
    results = Run(engine, victim).wait()
    assert isinstance(results["victim"], InvalidRequest) and "temperature" in str(results["victim"])
    assert_others_identical(results, references)


def test_a_failed_shared_forward_reports_to_each_of_its_requests(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the batched decode failed")

    monkeypatch.setattr(StepRunner, "decode", broken)
    results = Run(engine).wait()
    # Every row shares the decode forward: each request ends, through its own on_done, with the error.
    assert sorted(results) == ["other0", "other1", "other2", "victim"]
    assert all(isinstance(result, RuntimeError) for result in results.values())


def test_a_request_that_could_never_fit_the_kv_budget_is_refused_up_front(tiny_llama):
    model, tokenizer = tiny_llama
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, kv_cache_bytes=64 * 1024), InMemoryStore(),
                    model_id="tiny")
    per_token = engine.core.owner.ledger.bytes_per_token
    with pytest.raises(InvalidRequest, match="--kv-cache-bytes"):
        engine.generate(GenerationParams(prompt=text_of_length(64 * 1024 // per_token), max_new_tokens=8))
    assert engine.generate(GenerationParams(prompt="short", max_new_tokens=4)).generated_tokens == 4
    engine.stop()


def test_requests_beyond_the_budget_wait_and_then_run_identically(tiny_llama):
    """Reserved at admission: the budget never runs out mid-decode; a request that does not fit waits its turn."""
    model, tokenizer = tiny_llama
    prompt = text_of_length(40)
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="tiny")
    per_token = engine.core.owner.ledger.bytes_per_token
    engine.stop()
    # Room for exactly two requests of 40 + 12 tokens at a time.
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8, kv_cache_bytes=2 * 52 * per_token),
                    InMemoryStore(), model_id="tiny")
    most_in_use, step = [0], engine.core.step

    def watched():
        step()
        most_in_use[0] = max(most_in_use[0], engine.core.owner.ledger.bytes_in_use)

    engine.core.step = watched
    outcomes = engine.generate_batch([GenerationParams(prompt=prompt + str(i), max_new_tokens=12) for i in range(5)])
    expected = [reference_ids(model, tokenize_prompt(tokenizer, prompt + str(i))[0], 12) for i in range(5)]
    assert [o.output_token_ids for o in outcomes] == expected
    assert most_in_use[0] <= 2 * 53 * per_token
    engine.stop()
