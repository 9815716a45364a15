"""Continuous batching: requests join and leave one running batch between decode steps.

Every greedy request is checked against plain transformers `model.generate` on that prompt alone,
whatever else runs beside it (staggered arrivals, different lengths, prefix hits and misses,
cancellations, stop strings).
"""
from __future__ import annotations

import pytest

from inference_service.engine.engine import Engine, EngineConfig, GenerationParams
from inference_service.engine.prompts import tokenize_prompt
from inference_service.engine.scheduler import Scheduler, SchedulerLimits, StreamRequest
from inference_service.errors import InvalidRequest
from inference_service.store.memory import InMemoryStore
from tests.inference_service.engine.test_batch import reference_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SYSTEM = "The quick brown fox jumps over the lazy dog. " * 2
QUESTIONS = ["Q1?", "A much longer question here, with padding to spare?", "Mid-sized one?", "Why?",
             "Tell me about the fox and the dog, please."]


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def tiny_model(request):
    return request.getfixturevalue(request.param)


def make_scheduler(model, tokenizer, **limits) -> Scheduler:
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="scheduler-test")
    return Scheduler(engine.parts, SchedulerLimits(**limits))


class Tracked:
    """A StreamRequest with its streamed events and its end recorded."""

    def __init__(self, prompt: str, max_new_tokens: int = 12, mode: str = "prefix_cache", **fields) -> None:
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.indexed_ids: dict[int, list[int]] = {}  # streamed token ids per completion index
        self.outcome = None
        self.outcomes = None
        self.error = None
        self.stop_after: int | None = None  # cancel once this many tokens streamed
        self.params = GenerationParams(prompt=prompt, max_new_tokens=max_new_tokens, mode=mode,
                                       request_id=f"r{id(self) % 1000}", **fields)
        self.request = StreamRequest(self.params, self._on_token, self._should_stop, self._on_done)

    def _on_token(self, event) -> None:
        self.pieces.append(event.text)
        self.token_ids += list(event.token_ids)
        self.indexed_ids.setdefault(event.index, []).extend(event.token_ids)

    def _should_stop(self) -> bool:
        return self.stop_after is not None and len(self.token_ids) >= self.stop_after

    def _on_done(self, outcomes, error) -> None:
        assert self.outcome is None and self.error is None, "on_done is called once"
        assert (outcomes is None) != (error is None), "outcomes or an error"
        self.outcomes, self.error = outcomes, error
        self.outcome = None if outcomes is None else outcomes[0]

    @property
    def done(self) -> bool:
        return self.outcome is not None or self.error is not None


def run_until_done(scheduler: Scheduler, tracked: list[Tracked], arrivals: dict[int, list[Tracked]] | None = None,
                   max_steps: int = 500) -> list[int]:
    """Steps the scheduler, submitting arrivals[step] before that step; returns num_running per step."""
    arrivals = arrivals or {}
    running = []
    for step in range(max_steps):
        for item in arrivals.get(step, []):
            scheduler.submit(item.request)
        if all(item.done for item in tracked) and step > max(arrivals, default=0):
            return running
        scheduler.step()
        running.append(scheduler.num_running)
    raise AssertionError("requests did not finish")


def expected(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    return reference_ids(model, tokenize_prompt(tokenizer, prompt)[0], max_new_tokens)


def test_staggered_arrivals_of_different_lengths_match_generate_alone(tiny_model):
    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer)
    prompts = [SYSTEM + question for question in QUESTIONS] + ["short", "x" * 70]
    lengths = [12, 5, 20, 9, 16, 3, 14]
    tracked = [Tracked(prompt, n) for prompt, n in zip(prompts, lengths)]
    # Two at once, then one joining every few steps while the earlier ones decode.
    arrivals = {0: tracked[:2], 2: [tracked[2]], 3: [tracked[3]], 7: tracked[4:6], 11: [tracked[6]]}
    running = run_until_done(scheduler, tracked, arrivals)
    assert max(running) >= 3, "requests overlapped in the running batch"
    for item, prompt, n in zip(tracked, prompts, lengths):
        assert item.error is None
        assert item.outcome.output_token_ids == expected(model, tokenizer, prompt, n), prompt
        assert item.token_ids == item.outcome.output_token_ids
        assert "".join(item.pieces) == item.outcome.output_text


def test_prefix_hits_and_misses_side_by_side_match_generate_and_write_back(tiny_model):
    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer)
    first = Tracked(SYSTEM + QUESTIONS[0], 10)
    run_until_done(scheduler, [first], {0: [first]})
    scheduler.parts.writeback.flush()
    # The system prompt is now cached: these hit it, the baseline and the new prompt miss.
    hits = [Tracked(SYSTEM + question, 10) for question in QUESTIONS[1:3]]
    misses = [Tracked(SYSTEM + QUESTIONS[3], 10, mode="baseline"), Tracked("Something else entirely.", 10)]
    reuse = Tracked(SYSTEM + QUESTIONS[4], 10, mode="chunk_kv_reuse")
    tracked = hits + misses + [reuse]
    run_until_done(scheduler, tracked, {0: [hits[0], misses[0]], 1: [hits[1], reuse], 4: [misses[1]]})
    for item in tracked:
        assert item.outcome.output_token_ids == expected(model, tokenizer, item.params.prompt, 10)
    assert all(item.outcome.cached_tokens >= 80 for item in hits + [reuse])
    assert [item.outcome.cached_tokens for item in misses] == [0, 0]


def test_a_cancelled_request_leaves_mid_decode_and_the_others_are_unchanged(tiny_model):
    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer)
    tracked = [Tracked(SYSTEM + question, 16) for question in QUESTIONS[:3]]
    tracked[1].stop_after = 4  # the client goes away after 4 tokens
    run_until_done(scheduler, tracked, {0: tracked})
    assert tracked[1].outcome.finish_reason == "cancelled"
    assert tracked[1].outcome.generated_tokens == 4
    for item in (tracked[0], tracked[2]):
        assert item.outcome.output_token_ids == expected(model, tokenizer, item.params.prompt, 16)
    assert scheduler.num_running == 0 and scheduler.batch.num_live == 0, "no row is left in the batch"


def test_stop_strings_and_sampling_stay_per_request(tiny_model):
    model, tokenizer = tiny_model
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="scheduler-test")
    scheduler = Scheduler(engine.parts)
    prompt = SYSTEM + QUESTIONS[1]
    full = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=16, mode="baseline"))
    stop = full.output_text[5:7]
    alone = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=16, mode="baseline", stop=(stop,)))
    sampled_params = dict(temperature=0.9, top_k=20, seed=7)
    sampled_alone = engine.generate(GenerationParams(prompt=SYSTEM, max_new_tokens=12, mode="baseline",
                                                     **sampled_params))
    stopping = Tracked(prompt, 16, mode="baseline", stop=(stop,))
    sampled = Tracked(SYSTEM, 12, mode="baseline", **sampled_params)
    plain = Tracked(SYSTEM + QUESTIONS[2], 16)
    run_until_done(scheduler, [stopping, sampled, plain], {0: [plain, sampled], 2: [stopping]})
    assert stopping.outcome.finish_reason == alone.finish_reason == "stop"
    assert stopping.outcome.output_text == alone.output_text
    assert "".join(stopping.pieces) == alone.output_text
    assert sampled.outcome.output_token_ids == sampled_alone.output_token_ids, "a seeded sampler is per request"
    assert plain.outcome.output_token_ids == expected(model, tokenizer, plain.params.prompt, 16)


def test_limits_bound_the_running_batch_and_the_rest_wait(tiny_model):
    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer, max_running_requests=2)
    tracked = [Tracked(SYSTEM + question, 8) for question in QUESTIONS[:4]]
    running = run_until_done(scheduler, tracked, {0: tracked})
    assert max(running) == 2
    for item in tracked:
        assert item.outcome.output_token_ids == expected(model, tokenizer, item.params.prompt, 8)
    # A token budget that holds one request at a time: they run one after the other.
    one = len(tokenize_prompt(tokenizer, SYSTEM + QUESTIONS[1])[0]) + 8
    scheduler = make_scheduler(model, tokenizer, max_batch_tokens=one)
    tracked = [Tracked(SYSTEM + question, 8) for question in QUESTIONS[:3]]
    assert max(run_until_done(scheduler, tracked, {0: tracked})) == 1


def test_rows_that_joined_this_step_count_towards_the_limit(tiny_model):
    """A whole prefill (prompt logprobs) joins in the middle of admission; the next request must still wait."""
    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer, max_running_requests=1)
    tracked = [Tracked(SYSTEM + question, 6, prompt_logprobs=1) for question in QUESTIONS[:2]]
    running = run_until_done(scheduler, tracked, {0: tracked})
    assert max(running) == 1
    for item in tracked:
        assert item.outcome.output_token_ids == expected(model, tokenizer, item.params.prompt, 6)


def test_a_bad_request_fails_alone(tiny_model):
    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer)
    good = Tracked(SYSTEM, 6)
    bad = Tracked(SYSTEM, 10**6)  # over the server's max_new_tokens limit
    run_until_done(scheduler, [good, bad], {0: [bad, good]})
    assert isinstance(bad.error, InvalidRequest)
    assert good.outcome.output_token_ids == expected(model, tokenizer, SYSTEM, 6)


def test_a_long_prefill_runs_in_pieces_between_decode_steps_and_is_written_back(tiny_model):
    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer, max_prefill_tokens=8)
    decoding = Tracked("short", 20)
    long_prompt = SYSTEM + QUESTIONS[1]  # ~140 uncached tokens: ~18 pieces of 8
    long = Tracked(long_prompt, 6)
    scheduler.submit(decoding.request)
    scheduler.step()  # `short` (5 tokens) prefills in one piece and decodes
    scheduler.submit(long.request)
    tokens_while_prefilling = []
    while not long.token_ids:
        before = len(decoding.token_ids)
        scheduler.step()
        tokens_while_prefilling.append(len(decoding.token_ids) - before)
    assert len(tokens_while_prefilling) >= 140 // 8, "the prefill took one piece per step"
    assert all(count == 1 for count in tokens_while_prefilling[:-1]), "`short` decoded on every step meanwhile"
    run_until_done(scheduler, [decoding, long])
    assert long.outcome.output_token_ids == expected(model, tokenizer, long_prompt, 6)
    assert decoding.outcome.output_token_ids == expected(model, tokenizer, "short", 20)
    scheduler.parts.writeback.flush()
    again = Tracked(long_prompt, 6)
    run_until_done(scheduler, [again], {0: [again]})
    assert again.outcome.cached_tokens == long.outcome.prompt_tokens - 1, "every chunk of the pieces was stored"
    assert again.outcome.output_token_ids == long.outcome.output_token_ids


def test_requests_that_join_in_one_step_are_prefilled_in_one_forward(tiny_model, monkeypatch):
    from inference_service.engine import chunked_prefill

    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer)
    first = Tracked(SYSTEM + QUESTIONS[0], 4)
    run_until_done(scheduler, [first], {0: [first]})
    scheduler.parts.writeback.flush()  # SYSTEM's chunks are cached now: the next four start at different lengths
    together, original = [], chunked_prefill.prefill_rows
    monkeypatch.setattr(chunked_prefill, "prefill_rows", lambda model, rows, pad=0: together.append(
        [(row.start, len(row.token_ids)) for row in rows]) or original(model, rows, pad))
    tracked = [Tracked(SYSTEM + QUESTIONS[1], 10), Tracked("Something else entirely.", 10),
               Tracked(SYSTEM + QUESTIONS[0], 10), Tracked(QUESTIONS[3], 10, mode="baseline")]
    for item in tracked:
        scheduler.submit(item.request)
    scheduler.step()
    assert scheduler.num_running == 4, "all four joined in the first step"
    lengths = [len(tokenize_prompt(tokenizer, item.params.prompt)[0]) for item in tracked]
    # One forward for the four: 88 cached whole chunks, nothing, all but the last token, baseline.
    assert together == [[(88, lengths[0] - 88), (0, lengths[1]), (lengths[2] - 1, 1), (0, lengths[3])]]
    run_until_done(scheduler, tracked)
    for item in tracked:
        assert item.outcome.output_token_ids == expected(model, tokenizer, item.params.prompt, 10)


def test_joining_prefills_split_into_forwards_of_about_forward_tokens(tiny_model, monkeypatch):
    from inference_service.engine import chunked_prefill
    from inference_service.engine.scheduler import FORWARD_TOKENS

    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer)
    together, original = [], chunked_prefill.prefill_rows
    monkeypatch.setattr(chunked_prefill, "prefill_rows", lambda model, rows, pad=0: together.append(
        [len(row.token_ids) for row in rows]) or original(model, rows, pad))
    prompts = [letter * (FORWARD_TOKENS // 2 - 4) for letter in "abc"]  # by default two fit in one forward
    tracked = [Tracked(prompt, 6) for prompt in prompts]
    alone, plain = [], chunked_prefill.prefill
    monkeypatch.setattr(chunked_prefill, "prefill", lambda *args: alone.append(1) or plain(*args))
    first_tokens = []  # at each request's first token: how many prefills had run alone by then
    for item in tracked:
        scheduler.submit(item.request)
    original_join = scheduler._join
    scheduler._join = lambda request, prefilled: first_tokens.append(len(alone)) or original_join(request, prefilled)
    scheduler.step()
    lengths = [len(tokenize_prompt(tokenizer, prompt)[0]) for prompt in prompts]
    assert together == [lengths[:2]], "the first two in one forward; the third alone (the plain prefill)"
    assert first_tokens == [0, 0, 1], "the first two picked their first token before the third one's forward"
    assert scheduler.num_running == 3
    run_until_done(scheduler, tracked)
    for item, prompt in zip(tracked, prompts):
        assert item.outcome.output_token_ids == expected(model, tokenizer, prompt, 6)


def test_a_request_with_n_choices_decodes_as_n_rows_beside_others(tiny_model):
    model, tokenizer = tiny_model
    engine = Engine(model, tokenizer, EngineConfig(chunk_size=8), InMemoryStore(), model_id="scheduler-test")
    sampled = dict(temperature=0.9, top_k=20, seed=7)
    alone = engine.generate_choices(GenerationParams(prompt=SYSTEM, max_new_tokens=12, n=3, mode="baseline", **sampled))
    scheduler = Scheduler(engine.parts)
    plain = Tracked(SYSTEM + QUESTIONS[1], 10)
    choices = Tracked(SYSTEM, 12, mode="baseline", n=3, **sampled)
    greedy = Tracked(SYSTEM + QUESTIONS[2], 10, n=2)
    running = run_until_done(scheduler, [plain, choices, greedy], {0: [plain], 1: [choices], 3: [greedy]})
    assert max(running) == 6, "1 + 3 + 2 rows decoded together"
    assert [o.index for o in choices.outcomes] == [0, 1, 2]
    assert [o.output_token_ids for o in choices.outcomes] == [o.output_token_ids for o in alone], \
        "each choice's seeded stream is its own, whatever runs beside it"
    assert len({tuple(o.output_token_ids) for o in choices.outcomes}) > 1, "seed + index: the choices differ"
    assert {i: ids for i, ids in choices.indexed_ids.items()} == {o.index: o.output_token_ids for o in choices.outcomes}
    reference = expected(model, tokenizer, greedy.params.prompt, 10)
    assert [o.output_token_ids for o in greedy.outcomes] == [reference, reference]
    assert plain.outcome.output_token_ids == expected(model, tokenizer, plain.params.prompt, 10)
    stats = engine.stats()
    assert stats["requests"] == 1 + 3, "a request with n choices counts once (the n = 3 alone, then three here)"


def test_a_batch_calls_shared_prefix_runs_once_in_pieces_while_others_decode(tiny_model, monkeypatch):
    from inference_service.engine import batch, chunked_prefill

    model, tokenizer = tiny_model
    scheduler = make_scheduler(model, tokenizer, max_prefill_tokens=16)
    decoding = Tracked("short", 40)
    scheduler.submit(decoding.request)
    scheduler.step()
    run_tokens = []  # prompt tokens that went through the model from here on
    prefill, prefill_rows = chunked_prefill.prefill, chunked_prefill.prefill_rows
    monkeypatch.setattr(chunked_prefill, "prefill", lambda model, cache, ids, start: run_tokens.append(
        len(ids)) or prefill(model, cache, ids, start))
    monkeypatch.setattr(chunked_prefill, "prefill_rows", lambda model, rows, pad=0: run_tokens.extend(
        len(row.token_ids) for row in rows) or prefill_rows(model, rows, pad))
    prompts = [SYSTEM + question for question in QUESTIONS[:3]]
    ended = []
    requests = batch.batch_requests(
        scheduler.parts, [GenerationParams(prompt=p, max_new_tokens=8, mode="prefix_cache", request_id=f"r{i}")
                          for i, p in enumerate(prompts)], False, lambda: False,
        lambda outcomes, error: ended.append((outcomes, error)))
    for request in requests:
        scheduler.submit(request)
    tokens_per_step = []
    while not ended:
        before = len(decoding.token_ids)
        scheduler.step()
        tokens_per_step.append(len(decoding.token_ids) - before)
    (outcomes, error), = ended
    assert error is None
    lengths = [len(tokenize_prompt(tokenizer, p)[0]) for p in prompts]
    assert sum(run_tokens) == 88 + sum(n - 88 for n in lengths), "the 88 shared tokens ran once for the three"
    assert max(run_tokens) <= 16, "in pieces of the step's budget"
    assert all(count == 1 for count in tokens_per_step[:88 // 16]), "`short` decoded on every step meanwhile"
    assert [o.output_token_ids for o in outcomes] == [expected(model, tokenizer, p, 8) for p in prompts]
    assert [o.cached_tokens for o in outcomes] == [0, 0, 0], "nothing came from the store"
