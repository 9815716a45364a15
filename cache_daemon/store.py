"""LMDB persistence of blobs and metadata: the only module that imports lmdb."""
from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb

from cache_daemon.entry import DIGEST_SIZE, ChunkKey, Entry

logger = logging.getLogger(__name__)

BLOBS_DB = b"blobs"  # key -> blob bytes
META_DB = b"meta"  # key -> encoded Entry
CONTENT_DB = b"content"  # content key -> prefix keys (sorted duplicates)
INFO_DB = b"info"  # facts about the environment itself, such as its identity
ENVIRONMENT_ID_KEY = b"environment_id"  # 16 random bytes, written once when the environment is created
# The layout co-located readers rely on (see DescribeReply.blob_db_version): BLOBS_DB maps a prefix key
# to the blob bytes exactly as stored, nothing before or after them.
BLOB_DB_VERSION = 1

_META_VERSION = 1
# version, size_bytes, checksum, frequency, last_access, pinned, num_tokens, namespace; then the
# content key (0 or 32 bytes) fills the rest of the value.
_META = struct.Struct(f"<BQIddBI{DIGEST_SIZE}s")

T = TypeVar("T")
Put = tuple[ChunkKey, Entry, bytes]


def encode_entry(entry: Entry) -> bytes:
    fixed = _META.pack(_META_VERSION, entry.size_bytes, entry.checksum, entry.frequency, entry.last_access,
                       entry.pinned, entry.num_tokens, entry.namespace)
    return fixed + entry.content_key


def decode_entry(value: bytes) -> Entry:
    version, size_bytes, checksum, frequency, last_access, pinned, num_tokens, namespace = _META.unpack_from(value)
    assert version == _META_VERSION, f"unknown metadata version {version}"
    return Entry(namespace=namespace, content_key=bytes(value[_META.size:]), num_tokens=num_tokens,
                 size_bytes=size_bytes, checksum=checksum, frequency=frequency, last_access=last_access,
                 pinned=bool(pinned))


class _TxnGate:
    """Many transactions at once, or one map resize alone (LMDB forbids resizing under open txns)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._num_open = 0
        self._resizing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._resizing)
            self._num_open += 1
        try:
            yield
        finally:
            with self._condition:
                self._num_open -= 1
                self._condition.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._resizing)
            self._resizing = True
            self._condition.wait_for(lambda: self._num_open == 0)
        try:
            yield
        finally:
            with self._condition:
                self._resizing = False
                self._condition.notify_all()


class LmdbStore:
    """One LMDB environment with three named DBs; every write call is one transaction."""

    def __init__(self, path: Path, map_size: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock_file = _lock_exclusively(path / "owner.lock")
        # meminit=False: blob pages are overwritten whole, zeroing them first is wasted work.
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=4, subdir=True, meminit=False)
        stale_readers = self._env.reader_check()
        if stale_readers:
            logger.info("cleared %d stale LMDB readers left by a dead process", stale_readers)
        self._blobs = self._env.open_db(BLOBS_DB)
        self._meta = self._env.open_db(META_DB)
        self._content = self._env.open_db(CONTENT_DB, dupsort=True)
        self.environment_id = self._ensure_environment_id(self._env.open_db(INFO_DB))
        self._gate = _TxnGate()
        self._write_lock = threading.Lock()

    def _ensure_environment_id(self, info_db) -> bytes:
        with self._env.begin(write=True, db=info_db) as txn:
            existing = txn.get(ENVIRONMENT_ID_KEY)
            if existing is not None:
                return bytes(existing)
            environment_id = os.urandom(16)
            txn.put(ENVIRONMENT_ID_KEY, environment_id)
            return environment_id

    @property
    def map_size(self) -> int:
        return self._env.info()["map_size"]

    def load_entries(self) -> dict[ChunkKey, Entry]:
        with self._gate.shared(), self._env.begin(db=self._meta) as txn:
            return {ChunkKey(key): decode_entry(value) for key, value in txn.cursor()}

    def content_matches(self, content_keys: Sequence[bytes]) -> list[list[ChunkKey]]:
        """For each content key, the prefix keys stored with it (one read txn for all)."""
        with self._gate.shared(), self._env.begin(db=self._content) as txn:
            cursor = txn.cursor()
            return [[ChunkKey(key) for key in cursor.iternext_dup()] if cursor.set_key(content_key) else []
                    for content_key in content_keys]

    def read_blob(self, key: ChunkKey, copy_out: Callable[[memoryview], T]) -> T | None:
        """copy_out(view of the blob) inside a short read txn; it must copy what it keeps."""
        with self._gate.shared(), self._env.begin(db=self._blobs, buffers=True) as txn:
            view = txn.get(key)
            return None if view is None else copy_out(memoryview(view))

    def write(self, puts: Sequence[Put] = (), updates: Sequence[tuple[ChunkKey, Entry]] = (),
              deletes: Sequence[tuple[ChunkKey, Entry]] = ()) -> None:
        """Puts new chunks, rewrites metadata, deletes chunks: all in one transaction."""
        with self._write_lock:
            while True:
                try:
                    with self._gate.shared(), self._env.begin(write=True) as txn:
                        self._apply(txn, puts, updates, deletes)
                    return
                except lmdb.MapFullError:
                    self._grow_map(sum(len(blob) for _, _, blob in puts))

    def _apply(self, txn, puts: Sequence[Put], updates: Sequence[tuple[ChunkKey, Entry]],
               deletes: Sequence[tuple[ChunkKey, Entry]]) -> None:
        for key, entry in deletes:
            txn.delete(key, db=self._blobs)
            txn.delete(key, db=self._meta)
            if entry.content_key:
                txn.delete(entry.content_key, key, db=self._content)
        for key, entry, blob in puts:
            txn.put(key, blob, db=self._blobs)
            txn.put(key, encode_entry(entry), db=self._meta)
            if entry.content_key:
                txn.put(entry.content_key, key, db=self._content)
        for key, entry in updates:
            # Only rewrite metadata of chunks still stored: an update never resurrects a deleted key.
            if txn.get(key, db=self._meta) is not None:
                txn.put(key, encode_entry(entry), db=self._meta)

    def _grow_map(self, bytes_needed: int) -> None:
        with self._gate.exclusive():
            old_size = self.map_size
            new_size = max(2 * old_size, old_size + 2 * bytes_needed)
            self._env.set_mapsize(new_size)
        logger.info("LMDB map was full: grew map_size from %d to %d bytes", old_size, new_size)

    def clear_stale_readers(self) -> int:
        """Frees the reader slots of processes that died inside a read transaction (a co-located service
        killed mid-read), so the pages their snapshots held can be reused. Returns how many were freed."""
        cleared = self._env.reader_check()
        if cleared:
            logger.info("cleared %d stale LMDB readers left by a dead process", cleared)
        return cleared

    def file_size(self) -> int:
        return (self.path / "data.mdb").stat().st_size

    def sync(self) -> None:
        self._env.sync(True)

    def close(self) -> None:
        self._env.close()
        self._lock_file.close()


def _lock_exclusively(path: Path):
    """One process per data dir: LMDB would allow more, but each keeps its own index in memory.
    The OS drops the lock when the process dies, kill -9 included."""
    lock_file = open(path, "a")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        raise RuntimeError(f"{path.parent} is in use by another cache daemon") from None
    return lock_file
