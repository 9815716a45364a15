"""The tenancy secret: from a file given to every daemon, never from Redis; a changed file is refused, not obeyed."""
from __future__ import annotations

import pytest

from cache_daemon.errors import StartupError
from cache_daemon.store import LmdbStore
from cache_daemon.tenancy_secret import LOCAL_SECRET_KEY, tenancy_secret


@pytest.fixture()
def store(tmp_path):
    lmdb = LmdbStore(tmp_path / "lmdb", 64 << 20)
    yield lmdb
    lmdb.close()


def secret_file(tmp_path, hex_digits: str, name: str = "tenancy.secret"):
    path = tmp_path / name
    path.write_text(hex_digits + "\n")
    return path


def test_without_a_file_the_lmdb_keeps_its_own_secret_across_restarts(store):
    first = tenancy_secret(store, None)
    assert len(first) == 32 and tenancy_secret(store, None) == first


def test_the_file_is_the_secret_and_the_same_file_is_accepted_again(tmp_path, store):
    path = secret_file(tmp_path, "ab" * 32)
    assert tenancy_secret(store, path) == bytes.fromhex("ab" * 32)
    assert tenancy_secret(store, path) == bytes.fromhex("ab" * 32)


def test_another_file_later_is_refused_rather_than_a_silent_new_key_space(tmp_path, store):
    tenancy_secret(store, secret_file(tmp_path, "ab" * 32))
    with pytest.raises(StartupError, match="not the secret this LMDB's tenant chunks were stored under"):
        tenancy_secret(store, secret_file(tmp_path, "cd" * 32, "other.secret"))


def test_switching_from_the_lmdb_secret_to_a_file_is_logged(tmp_path, store, caplog):
    tenancy_secret(store, None)
    assert store.info_items(LOCAL_SECRET_KEY).get(b"") is not None
    tenancy_secret(store, secret_file(tmp_path, "ab" * 32))
    assert any("no longer reachable" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("text", ["", "abcd", "zz" * 32, "ab" * 33])
def test_a_malformed_file_says_how_to_make_one(tmp_path, store, text):
    with pytest.raises(StartupError, match=r"64 hex digits; make one"):
        tenancy_secret(store, secret_file(tmp_path, text))
