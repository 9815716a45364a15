"""Prompts to segments of token ids: which tokenization each request shape gets (the byte tokenizer: one id per byte)."""
from __future__ import annotations

import pytest

from kvboost_keys.prompts import plan_prompt, tokenize_request, tokenize_warm
from kvboost_keys.namespace import Namespace
from tests.factories import build_byte_tokenizer

NAMESPACE = Namespace(bytes(32))


def ids(text: str) -> list[int]:
    return list(build_byte_tokenizer()(text, add_special_tokens=False)["input_ids"])


def test_a_request_is_its_prompt_else_its_messages_else_its_segments():
    tokenizer = build_byte_tokenizer()
    assert tokenize_request(tokenizer, "ab", None, None) == [ids("ab")]
    chat = tokenize_request(tokenizer, None, [("user", "hi")], None)
    # The generation prompt closes the template, as Generate applies it.
    assert chat == [ids("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")]
    assert tokenize_request(tokenizer, None, None, ["ab", "cd"]) == [ids("ab"), ids("cd")]


def test_a_warm_up_is_a_chat_prefix_a_document_or_raw_text():
    tokenizer = build_byte_tokenizer()
    assert tokenize_warm(tokenizer, None, [("system", "s")], False) == [ids("<|im_start|>system\ns<|im_end|>\n")]
    # A document is a later segment followed by an empty one, so its partial last chunk is a chunk.
    assert tokenize_warm(tokenizer, "doc", None, True) == [ids("doc"), []]
    assert tokenize_warm(tokenizer, "doc", None, False) == [ids("doc")]
    with pytest.raises(ValueError, match="text or messages"):
        tokenize_warm(tokenizer, "", None, False)


def test_a_warmed_document_keys_its_last_partial_chunk_by_content():
    plan = plan_prompt(NAMESPACE, [[1, 2, 3, 4, 5], []], chunk_size=4)
    # [1 2 3 4] and the partial [5] are chunks; nothing is left for the tail.
    assert [chunk.token_ids for chunk in plan.chunks.chunks] == [(1, 2, 3, 4), (5,)]
    assert plan.chunks.tail == () and plan.tail_key is None
