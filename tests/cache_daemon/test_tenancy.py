"""cache_daemon.tenancy: the keyed permutation of each tenant's keys and the tenants file."""
from __future__ import annotations

import json

import pytest

from cache_daemon.tenancy import PLAIN, KeySpace, Tenancy, Tenant, load_tenants_file, parse_tenants, tenant_secret
from tests.daemon_support import digest

SECRET = bytes(range(32))


def space(name: str) -> KeySpace:
    return KeySpace(tenant_secret(SECRET, name))


def test_scope_is_a_permutation_that_unscope_inverts() -> None:
    alice = space("alice")
    keys = [digest(index) for index in range(200)] + [bytes(32), b"\xff" * 32]
    scoped = alice.scope_all(keys)
    assert len(set(scoped)) == len(keys)
    assert all(stored != key for stored, key in zip(scoped, keys))
    assert [alice.unscope(stored) for stored in scoped] == keys


def test_the_same_key_lands_elsewhere_for_each_tenant_and_each_daemon() -> None:
    key = digest("system prompt chunk 0")
    placements = {space("alice").scope(key), space("bob").scope(key),
                  KeySpace(tenant_secret(b"\x01" * 32, "alice")).scope(key)}
    assert len(placements) == 3
    # Deterministic: a restart with the same secret finds the same places.
    assert space("alice").scope(key) == space("alice").scope(key)
    assert space("alice").scope(key).hex() == KeySpace(tenant_secret(SECRET, "alice")).scope(key).hex()


def test_bob_cannot_reach_alices_place_by_sending_her_stored_key() -> None:
    # Even holding a stored key of Alice (from a log line), Bob's sent keys are moved again.
    stored_by_alice = space("alice").scope(digest(1))
    assert space("bob").scope(stored_by_alice) != stored_by_alice


def test_scoping_is_not_a_mask_one_pair_would_reveal() -> None:
    # With stored = sent XOR mask, (k1 ^ s1) == (k2 ^ s2) for every pair; a permutation breaks that.
    bob = space("bob")
    masks = {bytes(a ^ b for a, b in zip(key, bob.scope(key))) for key in (digest(1), digest(2), digest(3))}
    assert len(masks) == 3


def test_empty_content_keys_stay_empty_and_plain_space_is_the_identity() -> None:
    assert space("alice").scope_optional(b"") == b""
    assert space("alice").unscope_optional(b"") == b""
    assert PLAIN.scope(digest(7)) == digest(7) and PLAIN.unscope(digest(7)) == digest(7)


def test_admins_get_the_plain_space_tenants_their_own() -> None:
    admin, alice = Tenant("ops", admin=True), Tenant("alice")
    tenancy = Tenancy(SECRET, [admin, alice])
    assert tenancy.space_of(admin) is PLAIN
    assert tenancy.space_of(alice).scope(digest(1)) == space("alice").scope(digest(1))
    # Namespaces get an owner the first time a tenant stores in them; admins own none.
    assert tenancy.new_namespaces(alice, [digest("ns"), digest("ns")]) == {digest("ns"): "alice"}
    tenancy.record_owners({digest("ns"): "alice"})
    assert tenancy.new_namespaces(alice, [digest("ns")]) == {}
    assert tenancy.new_namespaces(admin, [digest("other")]) == {}
    assert tenancy.owner_of(digest("ns")) == "alice" and tenancy.owner_of(digest("other")) is None


def test_tenants_file_with_tokens_token_files_roles_and_budgets(tmp_path) -> None:
    (tmp_path / "bob.token").write_text("bob-secret-token\n")
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {
        "alice": {"token": "alice-secret-token", "max_bytes": "64M"},
        "bob": {"token_file": "bob.token"},
        "ops": {"token": "ops-secret-token", "admin": True},
    }}))
    assert load_tenants_file(path) == {
        "alice-secret-token": Tenant("alice", max_bytes=64 << 20),
        "bob-secret-token": Tenant("bob"),
        "ops-secret-token": Tenant("ops", admin=True),
    }


@pytest.mark.parametrize("document, message", [
    ([], "JSON object"),
    ({"tenants": {}}, "no tenant"),
    ({"tenants": {"a": {"token": "t"}}, "extra": 1}, "JSON object"),
    ({"tenants": {"a": {}}}, "exactly one of token and token_file"),
    ({"tenants": {"a": {"token": "t", "token_file": "f"}}}, "exactly one"),
    ({"tenants": {"a": {"token": "  "}}}, "non-empty"),
    ({"tenants": {"a": {"token": "two words"}}}, "without whitespace"),
    ({"tenants": {"a": {"token": "t"}, "b": {"token": "t"}}}, "share a token"),
    ({"tenants": {"a b": {"token": "t"}}}, "must match"),
    ({"tenants": {"a": {"token": "t", "role": "admin"}}}, "fields among"),
    ({"tenants": {"a": {"token": "t", "admin": "yes"}}}, "true or false"),
    ({"tenants": {"a": {"token": "t", "max_bytes": "0"}}}, "positive"),
])
def test_a_malformed_tenants_file_is_refused(tmp_path, document, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tenants(document, tmp_path)


def test_a_tenants_file_that_is_not_json_is_refused(tmp_path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_tenants_file(path)
