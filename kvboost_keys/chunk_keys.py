"""Chunk keys: prefix-chained and content hashes over explicit token bytes, seeded by the namespace."""
from __future__ import annotations

import hashlib
import struct
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


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian unsigned integers (never Python's hash())."""
    for token_id in token_ids:
        if not 0 <= token_id <= _MAX_TOKEN_ID:
            raise ValueError(f"token id {token_id} does not fit in 4 bytes")
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


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
