"""salted_namespace: a per-request namespace that never changes keys when the salt is empty."""
from __future__ import annotations

import hashlib

from kvboost_keys.chunk_keys import prefix_keys
from kvboost_keys.namespace import Namespace, salted_namespace

NAMESPACE = Namespace(bytes(range(32)))


def test_empty_salt_keeps_the_namespace():
    assert salted_namespace(NAMESPACE, "") is NAMESPACE


def test_salt_is_sha256_of_namespace_then_salt():
    assert salted_namespace(NAMESPACE, "tenant-a") == hashlib.sha256(NAMESPACE + b"tenant-a").digest()


def test_different_salts_give_different_chunk_keys():
    chunks = [[1, 2, 3, 4]]
    plain = prefix_keys(NAMESPACE, chunks)
    salted_a = prefix_keys(salted_namespace(NAMESPACE, "a"), chunks)
    salted_b = prefix_keys(salted_namespace(NAMESPACE, "b"), chunks)
    assert len({plain[0], salted_a[0], salted_b[0]}) == 3
    assert prefix_keys(salted_namespace(NAMESPACE, "a"), chunks) == salted_a  # stable
