"""LmdbBlobReader against a real daemon store written by another process: snapshots, map growth, identity."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inference_service.store import lmdb_reader
from inference_service.store.lmdb_reader import LmdbBlobReader, LocalReadUnavailable

ROOT = Path(__file__).resolve().parents[3]
KEY_A, KEY_B, ABSENT = b"a" * 32, b"b" * 32, b"z" * 32

# The daemon's own LmdbStore, in a child process (LMDB allows one open of an environment per process).
WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from cache_daemon.entry import Entry
    from cache_daemon.store import LmdbStore

    store = LmdbStore(Path(sys.argv[1]), 1 << 20)

    def entry(size):
        return Entry(namespace=b"n" * 32, content_key=b"", num_tokens=1, size_bytes=size, checksum=0,
                     frequency=0.0, last_access=0.0, pinned=False)

    print(store.environment_id.hex(), flush=True)
    for line in sys.stdin:
        verb, key, size = line.split()
        key = key.encode() * 32
        if verb == "put":
            store.write(puts=[(key, entry(int(size)), key[:1] * int(size))])
        else:
            store.write(deletes=[(key, entry(int(size)))])
        print(store.map_size, flush=True)
""")


class Writer:
    def __init__(self, data_dir: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", WRITER, str(data_dir)], cwd=ROOT, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.environment_id = bytes.fromhex(self.process.stdout.readline())

    def send(self, verb: str, key: bytes, size: int) -> int:
        """Applies one write in the writer process; returns its map size after it."""
        self.process.stdin.write(f"{verb} {key[:1].decode()} {size}\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        assert self.process.wait(timeout=30) == 0


@pytest.fixture()
def writer(tmp_path):
    writer = Writer(tmp_path / "lmdb")
    writer.send("put", KEY_A, 100)
    yield writer
    writer.close()


def test_blobs_come_back_as_views_and_absent_keys_as_none(writer, tmp_path):
    reader = LmdbBlobReader(tmp_path / "lmdb", writer.environment_id)
    try:
        fetched = [(key, None if blob is None else bytes(blob)) for key, blob in reader.fetch([KEY_A, ABSENT])]
        assert fetched == [(KEY_A, b"a" * 100), (ABSENT, None)]
        assert reader.locked
    finally:
        reader.close()


def test_a_blob_evicted_during_a_fetch_stays_readable_until_the_fetch_ends(writer, tmp_path):
    reader = LmdbBlobReader(tmp_path / "lmdb", writer.environment_id)
    try:
        blobs = reader.fetch([KEY_A])
        _, view = next(blobs)
        writer.send("delete", KEY_A, 100)
        writer.send("put", KEY_B, 100)  # the writer may reuse free pages, but not the ones this snapshot holds
        assert bytes(view) == b"a" * 100
        blobs.close()
        assert [blob for _, blob in reader.fetch([KEY_A])] == [None], "a new fetch sees the eviction: a miss"
    finally:
        reader.close()


def test_the_reader_adopts_a_map_the_daemon_grew(writer, tmp_path):
    reader = LmdbBlobReader(tmp_path / "lmdb", writer.environment_id)
    try:
        first_map = writer.send("put", KEY_B, 10)
        grown_map = writer.send("put", KEY_B.replace(b"b", b"c"), 3 << 20)  # more than the whole first map
        assert grown_map > first_map
        assert [len(blob) for _, blob in reader.fetch([b"c" * 32])] == [3 << 20]
    finally:
        reader.close()


def test_another_environment_is_refused(writer, tmp_path):
    with pytest.raises(LocalReadUnavailable, match="another environment"):
        LmdbBlobReader(tmp_path / "lmdb", b"\x00" * 16)
    with pytest.raises(LocalReadUnavailable, match="cannot open"):
        LmdbBlobReader(tmp_path / "nothing here", writer.environment_id)
    with pytest.raises(LocalReadUnavailable, match="version 2"):
        LmdbBlobReader(tmp_path / "lmdb", writer.environment_id, blob_db_version=2)


def test_without_the_lock_file_each_blob_is_a_private_copy(writer, tmp_path, monkeypatch):
    opened = lmdb_reader._open

    def refuse_lock(path, lock):  # as on a read-only mount, where lock.mdb cannot be written
        if lock:
            raise lmdb_reader.lmdb.ReadonlyError("read-only file system")
        return opened(path, lock)

    monkeypatch.setattr(lmdb_reader, "_open", refuse_lock)
    reader = LmdbBlobReader(tmp_path / "lmdb", writer.environment_id)
    try:
        (_, blob), = reader.fetch([KEY_A])
        assert not reader.locked and type(blob) is bytes and blob == b"a" * 100
    finally:
        reader.close()
