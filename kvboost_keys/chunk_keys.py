"""Chunk keys: prefix-chained and content hashes over explicit token bytes, seeded by the namespace."""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from typing import Iterable, NewType, Sequence

from kvboost_keys.namespace import Namespace

# Commits to a chunk's tokens and to every token before it (at the same positions): equal
# prefix keys mean the K/V are interchangeable as they are, with no repair.
PrefixKey = NewType("PrefixKey", bytes)
# Commits to one chunk's tokens alone: equal content keys mean the same tokens, computed in
# some context, so a hit is approximate and must be repaired.
ContentKey = NewType("ContentKey", bytes)
DIGEST_SIZE = 32
_MAX_TOKEN_ID = 2**32 - 1


# The machine's 4-byte unsigned array type: its constructor range-checks every id in C.
_UINT32 = "I" if array("I").itemsize == 4 else "L"


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian unsigned integers (never Python's hash()).

    Raises:
        ValueError: an id below 0 or above 2**32 - 1.
    """
    try:
        packed = array(_UINT32, token_ids)
    except (OverflowError, TypeError):
        bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t <= _MAX_TOKEN_ID)), None)
        raise ValueError(f"token id {bad!r} does not fit in 4 bytes") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def hash_prefix_chunk(parent: bytes, token_ids: Sequence[int]) -> PrefixKey:
    """prefix_hash[i] = SHA256(prefix_hash[i-1] || tokens_i), with the namespace as prefix_hash[-1]."""
    assert len(parent) == DIGEST_SIZE, f"parent digest must be {DIGEST_SIZE} bytes, got {len(parent)}"
    return PrefixKey(hashlib.sha256(parent + encode_token_ids(token_ids)).digest())


def prefix_keys(namespace: Namespace, chunks: Iterable[Sequence[int]]) -> list[PrefixKey]:
    keys: list[PrefixKey] = []
    parent: bytes = namespace
    for token_ids in chunks:
        parent = hash_prefix_chunk(parent, token_ids)
        keys.append(PrefixKey(parent))
    return keys


def keys_of_packed(namespace: Namespace, packed: bytes, spans: Sequence[tuple[int, int]],
                   with_content: bool = True) -> tuple[list[PrefixKey], list[ContentKey]]:
    """(prefix keys, content keys) of the chunks at token spans [start, end) of a prompt whose ids are packed once
    (encode_token_ids): the same digests as prefix_keys and content_key, each chunk's bytes sliced, not re-packed."""
    assert len(namespace) == DIGEST_SIZE, f"namespace must be {DIGEST_SIZE} bytes, got {len(namespace)}"
    view = memoryview(packed)
    prefix: list[PrefixKey] = []
    content: list[ContentKey] = []
    parent = bytes(namespace)
    sha256 = hashlib.sha256
    for start, end in spans:
        chunk = view[4 * start : 4 * end]
        running = sha256(parent)
        running.update(chunk)
        parent = running.digest()
        prefix.append(PrefixKey(parent))
        if with_content:
            running = sha256(namespace)
            running.update(chunk)
            content.append(ContentKey(running.digest()))
    return prefix, content


def content_key(namespace: Namespace, token_ids: Sequence[int]) -> ContentKey:
    """content_hash = SHA256(namespace || tokens). Equals the prefix key of a chunk at the very start."""
    assert len(namespace) == DIGEST_SIZE, f"namespace must be {DIGEST_SIZE} bytes, got {len(namespace)}"
    return ContentKey(hashlib.sha256(namespace + encode_token_ids(token_ids)).digest())


def partial_prefix_keys(parent: bytes, token_ids: Sequence[int]) -> list[PrefixKey]:
    """hash_prefix_chunk(parent, token_ids[:n]) for n = len(token_ids) down to 1: the keys a partial chunk
    stored after `parent` would have if it held the first n of these tokens, longest first.

    One running SHA-256 serves every length (each key costs one 4-byte update and a copy).
    """
    assert len(parent) == DIGEST_SIZE, f"parent digest must be {DIGEST_SIZE} bytes, got {len(parent)}"
    running = hashlib.sha256(parent)
    keys: list[PrefixKey] = []
    for token_bytes in struct.iter_unpack("4s", encode_token_ids(token_ids)):
        running.update(token_bytes[0])
        keys.append(PrefixKey(running.copy().digest()))
    keys.reverse()
    return keys
