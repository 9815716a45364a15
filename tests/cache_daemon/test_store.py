"""LMDB store: round trips, one transaction per write, map growth, persistence, the owner lock."""
from __future__ import annotations

from pathlib import Path

import pytest

from cache_daemon.entry import ChunkKey, Entry
from cache_daemon.store import LmdbStore, decode_entry, encode_entry
from tests.daemon_support import NAMESPACE, digest


def make_entry(size_bytes: int, content_key: bytes = b"", frequency: float = 1.0, pinned: bool = False) -> Entry:
    return Entry(namespace=NAMESPACE, content_key=content_key, num_tokens=8, size_bytes=size_bytes,
                 checksum=1234, frequency=frequency, last_access=1700000000.5, pinned=pinned)


def make_put(label: str, size_bytes: int = 100, **fields) -> tuple[ChunkKey, Entry, bytes]:
    return ChunkKey(digest(label)), make_entry(size_bytes, **fields), bytes([len(label)]) * size_bytes


@pytest.fixture()
def store(tmp_path: Path):
    store = LmdbStore(tmp_path / "lmdb", map_size=1 << 20)
    yield store
    store.close()


def test_entry_encoding_round_trips_exactly() -> None:
    entry = make_entry(5, content_key=digest("c"), frequency=2.718281828459045, pinned=True)
    assert decode_entry(encode_entry(entry)) == entry
    assert decode_entry(encode_entry(make_entry(5))).content_key == b""


def test_written_chunks_read_back_and_copy_out_gets_a_view(store: LmdbStore) -> None:
    key, entry, blob = make_put("a")
    store.write(puts=[(key, entry, blob)])
    assert store.load_entries() == {key: entry}
    assert store.read_blob(key, bytes) == blob
    assert store.read_blob(key, lambda view: isinstance(view, memoryview)) is True
    assert store.read_blob(ChunkKey(digest("absent")), bytes) is None


def test_one_write_puts_updates_and_deletes_together(store: LmdbStore) -> None:
    first, second = make_put("first"), make_put("second")
    store.write(puts=[first, second])
    updated = make_entry(100, frequency=7.0)
    store.write(puts=[make_put("third")], updates=[(second[0], updated)], deletes=[(first[0], first[1])])
    assert store.load_entries() == {second[0]: updated, ChunkKey(digest("third")): make_put("third")[1]}
    assert store.read_blob(first[0], bytes) is None


def test_an_update_never_resurrects_a_deleted_key(store: LmdbStore) -> None:
    key, entry, blob = make_put("gone")
    store.write(puts=[(key, entry, blob)])
    store.write(deletes=[(key, entry)])
    store.write(updates=[(key, make_entry(100, frequency=3.0))])
    assert store.load_entries() == {}


def test_content_keys_map_to_every_prefix_key_holding_them(store: LmdbStore) -> None:
    shared = digest("document")
    a, b = make_put("a", content_key=shared), make_put("b", content_key=shared)
    store.write(puts=[a, b, make_put("c")])
    assert store.content_matches([shared, digest("unknown")]) == [sorted([a[0], b[0]]), []]
    store.write(deletes=[(a[0], a[1])])
    assert store.content_matches([shared]) == [[b[0]]]


def test_map_grows_when_a_write_does_not_fit(store: LmdbStore) -> None:
    assert store.map_size == 1 << 20
    big = make_put("big", size_bytes=3 << 20)
    store.write(puts=[big])
    assert store.map_size > 3 << 20
    assert store.read_blob(big[0], bytes) == big[2]


def test_committed_chunks_survive_reopening(tmp_path: Path) -> None:
    puts = [make_put(f"chunk {i}", size_bytes=50 + i) for i in range(20)]
    store = LmdbStore(tmp_path / "lmdb", map_size=1 << 20)
    store.write(puts=puts)
    store.close()
    reopened = LmdbStore(tmp_path / "lmdb", map_size=1 << 20)
    try:
        assert reopened.load_entries() == {key: entry for key, entry, _ in puts}
        assert all(reopened.read_blob(key, bytes) == blob for key, _, blob in puts)
    finally:
        reopened.close()


def test_a_second_store_on_the_same_dir_is_refused(store: LmdbStore) -> None:
    with pytest.raises(RuntimeError, match="in use by another cache daemon"):
        LmdbStore(store.path, map_size=1 << 20)


def test_a_refused_write_names_a_full_disk_only_when_the_disk_has_no_room(store: LmdbStore, monkeypatch) -> None:
    import collections
    import shutil

    import lmdb

    from cache_daemon.errors import DiskFull, WriteFailed

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 4096))
    full = store._write_error(lmdb.Error("mdb_txn_commit: No space left on device"), 1_000_000)
    assert isinstance(full, DiskFull) and "4096 bytes free" in str(full) and "--max-bytes" in str(full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, 1 << 40))
    other = store._write_error(lmdb.Error("mdb_txn_commit: Input/output error"), 1_000_000)
    assert isinstance(other, WriteFailed) and "Input/output error" in str(other)
