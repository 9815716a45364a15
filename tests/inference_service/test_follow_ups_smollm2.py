"""Real SmolLM2 through a running cache daemon, no explicit warm: follow-up questions on a document and the
turns of a chat recompute only what is new, and greedy outputs equal plain model.generate."""
from __future__ import annotations

import pytest
import torch

from inference_service.engine.engine import EngineConfig, GenerationParams
from kvboost_keys.prompts import tokenize_messages
from tests.inference_service.daemon_engine import engine_over_daemon
from tests.inference_service.test_identity import PASSAGE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_NEW_TOKENS = 12
QUESTIONS = ("What did the astronomer keep?", "Where was the observatory?", "Who learned to read from the notes?")


def shared_tokens(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference_ids(model, ids: list[int]) -> list[int]:
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=MAX_NEW_TOKENS)
    return output[0, len(ids):].tolist()


@pytest.fixture()
def engine(smollm2, tmp_path):
    with engine_over_daemon(smollm2, tmp_path / "lmdb", EngineConfig(chunk_size=128)) as engine:
        yield engine


def ask(engine, messages):
    outcome = engine.generate(GenerationParams(messages=tuple(messages), max_new_tokens=MAX_NEW_TOKENS,
                                               mode="prefix_cache"))
    engine.flush_writes()
    return outcome


def test_follow_up_questions_recompute_only_the_new_question(smollm2, engine):
    model, tokenizer, _ = smollm2
    document = PASSAGE * 3  # ~400 tokens
    seen: list[list[int]] = []
    for question in QUESTIONS:
        messages = [("system", "Answer from the document.\n" + document), ("user", question)]
        ids = tokenize_messages(tokenizer, tuple(messages))[0]
        outcome = ask(engine, messages)
        assert outcome.output_token_ids == reference_ids(model, ids), question
        if seen:
            shared = max(shared_tokens(ids, previous) for previous in seen)
            assert outcome.cached_tokens == min(shared, len(ids) - 1)
            assert len(ids) - outcome.cached_tokens <= len(tokenizer(question)["input_ids"]) + 6  # + template
        seen.append(ids)


def test_each_chat_turn_reuses_the_previous_turn_and_its_answer(smollm2, engine):
    model, tokenizer, _ = smollm2
    messages = [("system", "You are a helpful assistant. " + PASSAGE)]
    stored: list[list[int]] = []
    for turn, question in enumerate(QUESTIONS):
        messages.append(("user", question))
        ids = tokenize_messages(tokenizer, tuple(messages))[0]
        outcome = ask(engine, messages)
        assert outcome.output_token_ids == reference_ids(model, ids), turn
        if stored:
            assert outcome.cached_tokens == min(max(shared_tokens(ids, s) for s in stored), len(ids) - 1)
            new_tokens = len(ids) - outcome.cached_tokens
            # Only the new user message with its template (<|im_end|>, newlines, the user and assistant headers:
            # 11 tokens here), and the previous answer's last token, whose K/V was never computed.
            assert new_tokens <= len(tokenizer(question)["input_ids"]) + 11 + 1, (
                turn, new_tokens, tokenizer.decode(ids[outcome.cached_tokens:]))
        stored.append(ids + outcome.output_token_ids[:-1])
        messages.append(("assistant", outcome.output_text))
