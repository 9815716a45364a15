"""LmdbBlobReader against a real daemon store written by another process: snapshots, map growth, identity."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
    def __init__(self, data_dir: Path, wrap=lambda argv: argv) -> None:
        self.process = subprocess.Popen(wrap([sys.executable, "-c", WRITER, str(data_dir)]), cwd=ROOT, text=True,
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


# A reader in a child process that is PID 1 of its own PID namespace, as a container's entry point is.
ISOLATED_READER = textwrap.dedent("""
    import os, sys
    from inference_service.store.lmdb_reader import LmdbBlobReader, LocalReadUnavailable
    try:
        LmdbBlobReader(sys.argv[1], bytes.fromhex(sys.argv[2])).close()
        print(os.getpid(), "opened")
    except LocalReadUnavailable as error:
        print(os.getpid(), "refused:", error)
""")


def _in_new_pid_namespace(argv: list[str]) -> list[str]:
    return ["unshare", "--pid", "--fork", *argv]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="new PID namespaces need root and util-linux's unshare")
def test_a_reader_whose_pid_collides_with_the_writers_is_refused_never_read_unlocked(tmp_path):
    # Both processes are PID 1 of their own namespace: LMDB's reader table (one lock per PID in lock.mdb)
    # cannot tell them apart, so the reader cannot register, and it must not fall back to unlocked reads.
    writer = Writer(tmp_path / "lmdb", wrap=_in_new_pid_namespace)
    try:
        writer.send("put", KEY_A, 10)
        argv = [sys.executable, "-c", ISOLATED_READER, str(tmp_path / "lmdb"), writer.environment_id.hex()]
        isolated = subprocess.run(_in_new_pid_namespace(argv), cwd=ROOT, capture_output=True, text=True, timeout=60)
        shared = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        writer.close()
    assert isolated.stdout.startswith("1 refused: cannot open the LMDB environment"), isolated.stdout + isolated.stderr
    assert "with its lock file" in isolated.stdout
    assert shared.stdout.split()[1:] == ["opened"], "in the writer's PID namespace the reader registers"
