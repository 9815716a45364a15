"""Tokenization that does not redo what it has seen: a text's pieces between special tokens, cached by scope.

A fast tokenizer splits its input at added tokens before it normalizes, pre-tokenizes or runs its model, and
tokenizes every piece between them on its own (the `tokenizers` library's added vocabulary). So the ids of a text are
the ids of its pieces, with the special tokens' ids between them, exactly. A chat template puts a special token
around every message, so a long system message, document or earlier turn is a piece of its own: its ids are kept
here (keyed by SHA-256 over the scope and the piece's text) and a repeated one is not tokenized again.

Exact only where that splitting holds as stated: fast tokenizers whose added tokens strip nothing around them
(no lstrip, rstrip or single_word) and whose pre-tokenizer adds no prefix space to a piece (byte-level BPE:
GPT-2, SmolLM2, Qwen2, Llama 3). Others are tokenized whole every time (`TokenCache.reason` says why).
The scope is the request's cache namespace (model, tokenizer and its chat template, tenant salt): one tenant's
texts never make another's tokenization faster, and a change of tokenizer or template changes every key.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

logger = logging.getLogger(__name__)

# Token ids kept by default (4 bytes a token), by the service (--tokenizer-cache-bytes) and the router alike.
DEFAULT_TOKEN_CACHE_BYTES = 64 << 20

# Pieces shorter than this are tokenized every time (in one batch call): a cache entry would cost more than it saves.
MIN_CACHED_CHARS = 256
_ENTRY_OVERHEAD_BYTES = 240  # the key, the array object and the LRU's link, per entry (measured ~220)
# Above this many added tokens, splitting with one Python regex costs more than the tokenizer's own pass.
MAX_SPLITTING_TOKENS = 256
_PROBE_TEXTS = ("hello world", " two  words\n", "<probe>")


@dataclass(slots=True)
class TokenCacheStats:
    hits: int = 0  # pieces whose ids came from the cache
    misses: int = 0  # cacheable pieces tokenized (and kept)
    hit_tokens: int = 0  # ids served from the cache
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


def cacheable_reason(tokenizer) -> str:
    """Empty when the tokenizer splits at added tokens as this module assumes; else why it does not."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "not a fast tokenizer"
    definition = json.loads(backend.to_str())
    for token in definition.get("added_tokens") or ():
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return f"added token {token.get('content')!r} strips or matches whole words"
    num_splitting = len(_splitting_tokens(tokenizer))
    if num_splitting > MAX_SPLITTING_TOKENS:
        return f"{num_splitting} added tokens to split at (more than {MAX_SPLITTING_TOKENS}: slower than tokenizing)"
    if _adds_prefix_space(definition.get("pre_tokenizer")):
        return "its pre-tokenizer adds a prefix space to every piece"
    if not _splits_like_whole(tokenizer):
        return "pieces tokenized alone differ from the whole text"
    return ""


def _adds_prefix_space(pre_tokenizer) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_adds_prefix_space(part) for part in pre_tokenizer.get("pretokenizers", ()))
    if pre_tokenizer.get("type") == "Metaspace":
        return pre_tokenizer.get("prepend_scheme", "always") != "never"
    return bool(pre_tokenizer.get("add_prefix_space"))


def _splits_like_whole(tokenizer) -> bool:
    """A start-up check of the claim on a few texts around each special token (the property tests go wider)."""
    cache = TokenCache(tokenizer, max_bytes=0, checked=False)
    backend = tokenizer.backend_tokenizer
    specials = list(cache.special_ids)[:8] or [""]
    for special in specials:
        for text in _PROBE_TEXTS:
            whole = f"{text}{special} {text}{special}{text}"
            if cache.encode(whole, b"") != backend.encode(whole, add_special_tokens=False).ids:
                return False
    return True


class TokenCache:
    """Ids of long pieces of text (between special tokens), LRU under a byte budget, keyed by scope and text.

    encode(text, scope) equals tokenizer(text, add_special_tokens=False)["input_ids"]. Thread-safe.
    """

    def __init__(self, tokenizer, max_bytes: int, min_cached_chars: int = MIN_CACHED_CHARS,
                 checked: bool = True) -> None:
        assert max_bytes >= 0, f"max_bytes must be >= 0, got {max_bytes}"
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.min_cached_chars = min_cached_chars
        self.special_ids = _splitting_tokens(tokenizer)
        self._split = _split_pattern(self.special_ids)
        self.reason = cacheable_reason(tokenizer) if checked else ""
        self._added = _added_specials(tokenizer)
        self.stats = TokenCacheStats()
        self._entries: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and not self.reason

    def encode(self, text: str, scope: bytes) -> list[int]:
        """The ids of text without the tokenizer's own special tokens (BOS/EOS), as its chat template's output is
        tokenized; the long pieces from the cache when scope has seen them."""
        backend = self.tokenizer.backend_tokenizer
        if not self.enabled and self.reason:
            return backend.encode(text, add_special_tokens=False).ids
        parts = self._split.split(text) if self._split is not None else [text]
        # parts: text, special, text, special, ..., text (re.split keeps the captured specials at odd places)
        pieces: list[list[int] | array | None] = [None] * len(parts)
        keys: dict[int, bytes] = {}
        missing: list[int] = []
        for index, part in enumerate(parts):
            if index % 2:
                pieces[index] = [self.special_ids[part]]
            elif not part:
                pieces[index] = []
            elif len(part) >= self.min_cached_chars and self.max_bytes:
                key = hashlib.sha256(scope + b"\0" + part.encode("utf-8", "surrogatepass")).digest()
                keys[index] = key
                pieces[index] = self._get(key)
                if pieces[index] is None:
                    missing.append(index)
            else:
                missing.append(index)
        if missing:
            encoded = backend.encode_batch([parts[index] for index in missing], add_special_tokens=False)
            for index, encoding in zip(missing, encoded):
                pieces[index] = encoding.ids
                if index in keys:
                    self._put(keys[index], encoding.ids)
        if len(pieces) == 1:
            return list(pieces[0])
        ids: list[int] = []
        for piece in pieces:
            ids.extend(piece)
        return ids

    def encode_text(self, text: str, scope: bytes, add_special_tokens: bool = True) -> list[int]:
        """tokenizer(text, add_special_tokens=...)["input_ids"]."""
        if not add_special_tokens:
            return self.encode(text, scope)
        if self._added is None:  # the post-processor does more than put ids around the text
            return list(self.tokenizer(text)["input_ids"])
        before, after = self._added
        return before + self.encode(text, scope) + after

    def encode_chat(self, conversation: list[dict], scope: bytes, add_generation_prompt: bool) -> list[int]:
        """apply_chat_template(conversation, tokenize=True)'s ids: the rendered text, encoded as it does (without
        the tokenizer's own special tokens)."""
        rendered = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        return self.encode(rendered, scope)

    def _get(self, key: bytes) -> array | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            self.stats.hit_tokens += len(ids)
            return ids

    def _put(self, key: bytes, ids: Sequence[int]) -> None:
        size = _entry_bytes(len(ids))
        if size > self.max_bytes:
            return
        packed = array("I", ids)
        with self._lock:
            self.stats.misses += 1
            if key in self._entries:
                return
            self._entries[key] = packed
            self.stats.bytes += size
            while self.stats.bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.stats.bytes -= _entry_bytes(len(dropped))
                self.stats.evictions += 1
            self.stats.entries = len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stats.bytes = self.stats.entries = 0


def _added_specials(tokenizer) -> tuple[list[int], list[int]] | None:
    """(ids before, ids after) the text that tokenizer(text) adds (BOS, EOS), the same for every probe; None when
    they are not simply put around the text."""
    found = None
    for text in _PROBE_TEXTS:
        plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        full = list(tokenizer(text)["input_ids"])
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
        if start is None:
            return None
        around = (full[:start], full[start + len(plain):])
        if found is not None and around != found:
            return None
        found = around
    return found


def _entry_bytes(num_ids: int) -> int:
    return 4 * num_ids + _ENTRY_OVERHEAD_BYTES


def _splitting_tokens(tokenizer) -> dict[str, int]:
    """{content: id} of the added tokens the tokenizer splits raw text at (those matched before normalization)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {token.content: int(token_id) for token_id, token in decoder.items()
            if token.content and not getattr(token, "normalized", False)}


def _split_pattern(special_ids: dict[str, int]) -> re.Pattern | None:
    """Alternation of the tokens, longest first: at each place the longest token that matches wins, as the
    tokenizer's leftmost-longest matcher does."""
    if not special_ids:
        return None
    alternatives = sorted(special_ids, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(token) for token in alternatives) + ")")


def token_cache_for(tokenizer, max_bytes: int) -> TokenCache | None:
    """A cache for this tokenizer, said in the log; None when off (max_bytes 0) or when the tokenizer cannot be split
    as this module assumes (prompts are then tokenized whole)."""
    if max_bytes <= 0:
        return None
    cache = TokenCache(tokenizer, max_bytes)
    if cache.reason:
        logger.info("prompts are tokenized whole every time: %s", cache.reason)
        return None
    logger.info("tokenization cache: up to %d MiB of token ids of long prompt pieces", max_bytes >> 20)
    return cache


def token_cache_stats(cache: TokenCache | None) -> dict[str, int]:
    """The cache's counters as stats fields (zeros when there is none)."""
    stats = cache.stats if cache is not None else TokenCacheStats()
    return {"tokenizer_cache_hits": stats.hits, "tokenizer_cache_misses": stats.misses,
            "tokenizer_cache_hit_tokens": stats.hit_tokens, "tokenizer_cache_bytes": stats.bytes}
