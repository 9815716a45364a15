"""Chunk keys: exact digests recomputed here from design §3 with hashlib and struct."""
from __future__ import annotations

import dataclasses
import hashlib
import struct
import typing

import pytest

from kvboost_keys import chunk_keys as keys
from kvboost_keys.chunk_keys import (
    ContentKey, PrefixKey, content_key, encode_token_ids, hash_prefix_chunk, partial_prefix_keys, prefix_keys,
)
from kvboost_keys.namespace import Namespace, NamespaceSpec, namespace_digest

# The namespace of make_spec(), pinned so any change to the canonical JSON or hashing shows up here.
PINNED_NAMESPACE_HEX = "0da9b99c86049bf12f11053f17cbc6e1161210b2f156e539488fff4d26fc85ce"
# prefix_keys(that namespace, [[1, 2, 3, 4], [5, 6, 7, 8]])[1]
PINNED_SECOND_PREFIX_KEY_HEX = "609e4b852e0f3d366c0bd82a46879a25e97108388759c4d58212f070fee47d09"


def make_spec(**overrides) -> NamespaceSpec:
    fields = dict(
        weights_id="state-sha256:tiny-llama",
        config_json='{"layers":2}',
        dtype="float32",
        tokenizer_id="byte-tok",
        chunk_size=4,
        kv_cache_bits=16,
        format_version=1,
        tenant_salt="",
    )
    fields.update(overrides)
    return NamespaceSpec(**fields)


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def token_bytes(token_ids: list[int]) -> bytes:
    return b"".join(struct.pack("<I", token_id) for token_id in token_ids)


def test_encode_token_ids_is_4_byte_little_endian():
    assert encode_token_ids([1, 256, 2**32 - 1]) == bytes.fromhex("01000000" "00010000" "ffffffff")
    assert encode_token_ids([]) == b""


@pytest.mark.parametrize("bad_token_id", [-1, 2**32, 2**40])
def test_encode_token_ids_rejects_ids_outside_uint32(bad_token_id):
    with pytest.raises(ValueError, match="does not fit in 4 bytes"):
        encode_token_ids([5, bad_token_id])


def test_namespace_digest_is_sha256_of_sorted_compact_json():
    # Sorted keys, no whitespace; config_json is a string field, so its quotes are escaped.
    expected_json = (
        '{"chunk_size":4,"config_json":"{\\"layers\\":2}","dtype":"float32","format_version":1,'
        '"kv_cache_bits":16,"tenant_salt":"","tokenizer_id":"byte-tok",'
        '"weights_id":"state-sha256:tiny-llama"}'
    )
    namespace = namespace_digest(make_spec())
    assert namespace == sha256(expected_json.encode())
    assert namespace.hex() == PINNED_NAMESPACE_HEX


@pytest.mark.parametrize(
    "override",
    [
        {"tenant_salt": "tenant-b"},
        {"dtype": "bfloat16"},
        {"chunk_size": 8},
        {"kv_cache_bits": 8},
        {"kv_cache_bits": 4},
        {"weights_id": "state-sha256:tiny-qwen2"},
        {"config_json": '{"layers":3}'},
        {"tokenizer_id": "other-tok"},
        {"format_version": 2},
    ],
)
def test_every_spec_field_changes_the_namespace(override):
    assert namespace_digest(make_spec(**override)) != namespace_digest(make_spec())


def test_hash_prefix_chunk_chains_parent_and_token_bytes():
    namespace = namespace_digest(make_spec())
    expected = sha256(bytes.fromhex(PINNED_NAMESPACE_HEX) + bytes.fromhex("01000000" "02000000" "03000000" "04000000"))
    assert hash_prefix_chunk(namespace, [1, 2, 3, 4]) == expected


def test_hash_prefix_chunk_rejects_a_parent_of_the_wrong_size():
    with pytest.raises(AssertionError, match="32 bytes"):
        hash_prefix_chunk(b"short", [1])


def test_prefix_keys_chain_from_the_namespace():
    namespace = namespace_digest(make_spec())
    chunks = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    # prefix[-1] = namespace; prefix[i] = SHA256(prefix[i-1] || tokens_i)
    expected, parent = [], bytes(namespace)
    for chunk in chunks:
        parent = sha256(parent + token_bytes(chunk))
        expected.append(parent)
    assert prefix_keys(namespace, chunks) == expected
    assert expected[1].hex() == PINNED_SECOND_PREFIX_KEY_HEX
    assert prefix_keys(namespace, []) == []


def test_prefix_key_depends_on_every_earlier_chunk():
    namespace = namespace_digest(make_spec())
    original = prefix_keys(namespace, [[1, 2, 3, 4], [5, 6, 7, 8]])
    changed_first = prefix_keys(namespace, [[1, 2, 3, 9], [5, 6, 7, 8]])
    assert original[1] != changed_first[1]


def test_content_key_hashes_namespace_and_tokens_only():
    namespace = namespace_digest(make_spec())
    content = content_key(namespace, [5, 6, 7, 8])
    assert content == sha256(bytes(namespace) + token_bytes([5, 6, 7, 8]))
    # The same chunk after different preceding chunks: two prefix keys, one content key.
    after_a = prefix_keys(namespace, [[1, 2, 3, 4], [5, 6, 7, 8]])[1]
    after_b = prefix_keys(namespace, [[9, 9, 9, 9], [5, 6, 7, 8]])[1]
    assert len({after_a, after_b, content}) == 3


def test_first_chunk_prefix_key_equals_its_content_key():
    namespace = namespace_digest(make_spec())
    assert prefix_keys(namespace, [[1, 2, 3, 4]])[0] == content_key(namespace, [1, 2, 3, 4])


def test_different_namespaces_give_different_keys_for_the_same_tokens():
    tenant_a = namespace_digest(make_spec(tenant_salt="a"))
    tenant_b = namespace_digest(make_spec(tenant_salt="b"))
    assert content_key(tenant_a, [1, 2]) != content_key(tenant_b, [1, 2])
    assert prefix_keys(tenant_a, [[1, 2]]) != prefix_keys(tenant_b, [[1, 2]])


def test_key_kinds_are_distinct_newtypes_over_bytes():
    for key_type in (PrefixKey, ContentKey, Namespace):
        assert isinstance(key_type, typing.NewType) and key_type.__supertype__ is bytes
    assert typing.get_type_hints(namespace_digest)["return"] is Namespace
    assert typing.get_type_hints(keys.hash_prefix_chunk)["return"] is PrefixKey
    assert typing.get_type_hints(keys.prefix_keys)["return"] == list[PrefixKey]
    assert typing.get_type_hints(keys.content_key)["return"] is ContentKey
    assert len(namespace_digest(make_spec())) == keys.DIGEST_SIZE == 32


def test_namespace_spec_validates_its_fields():
    with pytest.raises(AssertionError, match="chunk_size"):
        make_spec(chunk_size=0)
    with pytest.raises(AssertionError, match="kv_cache_bits"):
        make_spec(kv_cache_bits=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_spec().chunk_size = 8


def test_partial_prefix_keys_are_the_prefix_keys_of_every_shorter_chunk_longest_first():
    parent = hashlib.sha256(b"parent").digest()
    tokens = [7, 300, 2**32 - 1, 0]

    keys = partial_prefix_keys(parent, tokens)

    # Recomputed from §3 with hashlib and struct: SHA256(parent || first n tokens as 4-byte LE), n = 4..1.
    expected = [hashlib.sha256(parent + struct.pack(f"<{n}I", *tokens[:n])).digest() for n in (4, 3, 2, 1)]
    assert keys == expected
    assert keys[0] == hash_prefix_chunk(parent, tokens)
    assert partial_prefix_keys(parent, []) == []


def test_plan_prompt_keys_from_packed_bytes_are_the_stored_keys():
    # Chunks stored before keys were hashed from one packed array stay valid: the pinned key, and every prefix and
    # content key equal to the per-chunk definitions, across segments (a partial chunk mid-prompt included).
    from kvboost_keys.prompts import plan_prompt

    namespace = namespace_digest(make_spec())
    plan = plan_prompt(namespace, [[1, 2, 3, 4, 5, 6, 7, 8]], 4)
    assert plan.prefix_keys[1].hex() == PINNED_SECOND_PREFIX_KEY_HEX
    segments = [[9, 1, 2, 3, 4, 5], [7, 7, 7, 7, 2**32 - 1], [3, 3]]
    plan = plan_prompt(namespace, segments, 4)
    chunk_ids = [list(chunk.token_ids) for chunk in plan.chunks.chunks]
    assert chunk_ids == [[9, 1, 2, 3], [4, 5], [7, 7, 7, 7], [2**32 - 1]]
    assert list(plan.prefix_keys) == prefix_keys(namespace, chunk_ids)
    assert list(plan.content_keys) == [sha256(namespace + token_bytes(ids)) for ids in chunk_ids]
    assert plan.tail_key == sha256(plan.prefix_keys[-1] + token_bytes([3, 3]))


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5])
def test_plan_prompt_refuses_ids_that_do_not_fit(bad):
    from kvboost_keys.prompts import plan_prompt

    with pytest.raises(ValueError, match="does not fit in 4 bytes"):
        plan_prompt(namespace_digest(make_spec()), [[1, 2, bad, 4, 5]], 4)
