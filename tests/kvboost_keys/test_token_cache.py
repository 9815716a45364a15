"""The tokenization cache gives the tokenizer's own ids for every text (Hypothesis over generated texts, both model
families' tokenizers and chat templates), skips known pieces, stays in its budget and in its scope."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_service.model import weights
from kvboost_common import catalogue
from kvboost_keys.prompts import tokenize_request, tokenize_warm
from kvboost_keys.token_cache import TokenCache, _entry_bytes, cacheable_reason

# The real tokenizers are read from the prepared models (the fast suite never touches the model cache).
pytestmark = pytest.mark.slow
SCOPE = b"s" * 32
OTHER_SCOPE = b"t" * 32
QWEN = catalogue.QWEN_CODER_05B


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return _tokenizer(weights.prepare_default_model())


@pytest.fixture(scope="module")
def qwen_tokenizer():
    folder = weights.converted_dir(QWEN)
    if weights.read_marker(folder) is None:
        pytest.skip(f"{QWEN.name} is not prepared: `make model MODEL={QWEN.name}` (make test does it)")
    return _tokenizer(folder)


@pytest.fixture(params=["smollm2", "qwen"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


# Texts that stress the joins: letters of several scripts, combining marks (NFC in Qwen's normalizer), digit runs
# (Qwen splits digits one by one), whitespace runs and newlines (the regex's lookahead), apostrophes (contractions),
# and the special tokens' own text.
_ALPHABET = st.sampled_from(list("ab xyZ\n\t  '0123456789.,!?-_é\u0301中文😀\r") + [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s", "  \n", "\n\n", "<|im_", "|>"])
TEXTS = st.lists(_ALPHABET, max_size=60).map("".join)
ROLES = st.sampled_from(["system", "user", "assistant"])


def reference_chat(tokenizer, conversation, add_generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("family", ["smollm2", "qwen"])
def test_both_families_are_cacheable(family, request):
    assert cacheable_reason(request.getfixturevalue(f"{family}_tokenizer")) == ""


@pytest.fixture()
def small_pieces_cache(tokenizer):
    """One cache for every generated example of a test (its start-up checks read the whole tokenizer definition):
    a low threshold, so generated pieces are cached, and entries of earlier examples stay to be hit or not."""
    return TokenCache(tokenizer, max_bytes=1 << 20, min_cached_chars=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(head=TEXTS, body=TEXTS, tail=TEXTS, repeat=st.integers(1, 12), add_special=st.booleans())
def test_text_ids_equal_the_tokenizers(tokenizer, small_pieces_cache, head, body, tail, repeat, add_special):
    # Each text twice, so the second comes from the cache.
    cache = small_pieces_cache
    known = head + body * repeat
    for text in (known, known + tail, tail + known, known + tail):
        expected = list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
        assert cache.encode_text(text, SCOPE, add_special) == expected, repr(text)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(st.tuples(ROLES, TEXTS), min_size=1, max_size=4), question=TEXTS,
       add_generation_prompt=st.booleans())
def test_chat_ids_equal_the_template_and_tokenizer(tokenizer, small_pieces_cache, messages, question,
                                                   add_generation_prompt):
    cache = small_pieces_cache
    conversation = [{"role": role, "content": content} for role, content in messages]
    for turn in (conversation, conversation + [{"role": "user", "content": question}], conversation):
        expected = reference_chat(tokenizer, turn, add_generation_prompt)
        assert cache.encode_chat(turn, SCOPE, add_generation_prompt) == expected


def test_a_repeated_system_prompt_is_not_tokenized_again(smollm2_tokenizer):
    cache = TokenCache(smollm2_tokenizer, max_bytes=1 << 20)
    document = "The cache keeps the keys and values of every chunk it has seen. " * 40
    first = tokenize_request(smollm2_tokenizer, None, [("system", document), ("user", "Why?")], None, cache, SCOPE)
    assert (cache.stats.hits, cache.stats.misses) == (0, 1)  # the system message is the one long piece
    second = tokenize_request(smollm2_tokenizer, None, [("system", document), ("user", "How?")], None, cache, SCOPE)
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    # The piece between <|im_start|> and <|im_end|>: the role's line and the message.
    assert cache.stats.hit_tokens == len(smollm2_tokenizer("system\n" + document, add_special_tokens=False)["input_ids"])
    for ids, question in ((first, "Why?"), (second, "How?")):
        assert ids == [reference_chat(smollm2_tokenizer, [{"role": "system", "content": document},
                                                          {"role": "user", "content": question}], True)]


def test_segments_and_warm_use_the_cache_with_the_same_ids(smollm2_tokenizer):
    cache = TokenCache(smollm2_tokenizer, max_bytes=1 << 20)
    document = "Chunks of a document have the same keys wherever it appears. " * 20
    for _ in range(2):
        assert tokenize_request(smollm2_tokenizer, None, None, [document, "Q?"], cache, SCOPE) == \
            tokenize_request(smollm2_tokenizer, None, None, [document, "Q?"])
        assert tokenize_warm(smollm2_tokenizer, document, None, True, cache, SCOPE) == \
            tokenize_warm(smollm2_tokenizer, document, None, True)
    assert cache.stats.hits >= 2


def test_one_scope_never_serves_another(smollm2_tokenizer):
    # Tenants' namespaces differ (salted): tenant B's first sight of tenant A's text is a miss, so A's texts never
    # make B's tokenization faster.
    cache = TokenCache(smollm2_tokenizer, max_bytes=1 << 20)
    text = "A confidential document that only tenant A has sent. " * 20
    cache.encode_text(text, SCOPE)
    cache.encode_text(text, SCOPE)
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    cache.encode_text(text, OTHER_SCOPE)
    assert (cache.stats.hits, cache.stats.misses) == (1, 2)


def test_the_budget_bounds_memory_least_recently_used_first(smollm2_tokenizer):
    texts = [f"Document number {i} is long enough to be kept in the cache. " * 8 for i in range(6)]
    one = _entry_bytes(len(smollm2_tokenizer(texts[0], add_special_tokens=False)["input_ids"]))
    cache = TokenCache(smollm2_tokenizer, max_bytes=3 * one)
    for text in texts:
        cache.encode_text(text, SCOPE, add_special_tokens=False)
    assert cache.stats.bytes <= 3 * one and cache.stats.entries == 3 and cache.stats.evictions == 3
    cache.encode_text(texts[0], SCOPE, add_special_tokens=False)  # evicted: tokenized again
    cache.encode_text(texts[5], SCOPE, add_special_tokens=False)  # the newest: kept
    assert (cache.stats.hits, cache.stats.misses) == (1, 7)


def test_off_with_no_budget(smollm2_tokenizer):
    cache = TokenCache(smollm2_tokenizer, max_bytes=0)
    text = "Nothing is kept when the budget is zero. " * 20
    assert cache.encode_text(text, SCOPE) == list(smollm2_tokenizer(text)["input_ids"])
    assert cache.encode_text(text, SCOPE) == list(smollm2_tokenizer(text)["input_ids"])
    assert (cache.stats.hits, cache.stats.misses, cache.stats.entries) == (0, 0, 0)


def test_a_tokenizer_that_strips_around_added_tokens_is_tokenized_whole(smollm2_tokenizer):
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    stripping = PreTrainedTokenizerFast(tokenizer_object=smollm2_tokenizer.backend_tokenizer.__class__.from_str(
        smollm2_tokenizer.backend_tokenizer.to_str()))
    stripping.add_special_tokens({"additional_special_tokens": [AddedToken("<sep>", lstrip=True)]})
    cache = TokenCache(stripping, max_bytes=1 << 20, min_cached_chars=1)
    assert "strips" in cache.reason and not cache.enabled
    text = "left   <sep> right " * 30
    assert cache.encode_text(text, SCOPE) == list(stripping(text)["input_ids"])
    assert cache.stats.entries == 0


def test_a_changed_template_or_tokenizer_changes_the_scope(smollm2_tokenizer):
    # The engine scopes entries by the request's namespace, which digests the tokenizer and its chat template
    # (tokenizer_identity): a new template gives new keys, so no entry outlives the template it was made under.
    import copy

    from kvboost_keys.namespace import tokenizer_identity

    changed = copy.deepcopy(smollm2_tokenizer)
    changed.chat_template = smollm2_tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert tokenizer_identity(changed) != tokenizer_identity(smollm2_tokenizer)
    cache = TokenCache(smollm2_tokenizer, max_bytes=1 << 20)
    text = "The same long system message under two templates. " * 20
    cache.encode_text(text, tokenizer_identity(smollm2_tokenizer).encode())
    cache.encode_text(text, tokenizer_identity(changed).encode())
    assert (cache.stats.hits, cache.stats.misses) == (0, 2)
