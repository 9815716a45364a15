"""LMDB persistence of blobs and metadata: the only module that imports lmdb."""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import shutil
import struct
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb
import numpy as np

from cache_daemon.entry import DIGEST_SIZE, ChunkKey, Entry
from cache_daemon.errors import DiskFull, WriteFailed

logger = logging.getLogger(__name__)

BLOBS_DB = b"blobs"  # key -> blob bytes
META_DB = b"meta"  # key -> encoded Entry
CONTENT_DB = b"content"  # content key -> prefix keys (sorted duplicates)
INFO_DB = b"info"  # facts about the environment itself, such as its identity
CHILDREN_DB = b"children"  # parent key + child key (64 bytes) -> the child's token ids (packed uint32)
PARENTS_DB = b"parents"  # child key -> parent key: what deleting the child must remove from CHILDREN_DB
ENVIRONMENT_ID_KEY = b"environment_id"  # 16 random bytes, written once when the environment is created
META_VERSION_KEY = b"meta_version"  # the _META_VERSION every value in META_DB has
# The layout co-located readers rely on (see DescribeReply.blob_db_version): BLOBS_DB maps a prefix key
# to the blob bytes exactly as stored, nothing before or after them.
BLOB_DB_VERSION = 1

_META_VERSION = 2
# version, size_bytes, checksum, frequency, last_access, pinned, num_tokens, namespace, slot; then the
# content key (0 or 32 bytes) fills the rest of the value. Version 1 had no slot (migrated on open).
_META = struct.Struct(f"<BQIddBI{DIGEST_SIZE}si")
_META_V1 = struct.Struct(f"<BQIddBI{DIGEST_SIZE}s")
_NAMESPACE_OFFSET = 34  # where the namespace starts in a value, in both versions
# The fixed part of a version-2 value as numpy reads it, for decoding many values at once.
META_DTYPE = np.dtype([("version", "u1"), ("size_bytes", "<u8"), ("checksum", "<u4"), ("frequency", "<f8"),
                       ("last_access", "<f8"), ("pinned", "u1"), ("num_tokens", "<u4"),
                       ("namespace", f"V{DIGEST_SIZE}"), ("slot", "<i4")])
assert META_DTYPE.itemsize == _META.size and _META_V1.size == _NAMESPACE_OFFSET + DIGEST_SIZE

T = TypeVar("T")
Put = tuple[ChunkKey, Entry, bytes]
Continuation = tuple[ChunkKey, bytes, bytes]  # (child key, parent key, packed token ids)
HeldChunk = tuple[ChunkKey, Entry, bytes]  # (key, metadata, parent key; b"" when not indexed as a continuation)


def encode_entry(entry: Entry) -> bytes:
    fixed = _META.pack(_META_VERSION, entry.size_bytes, entry.checksum, entry.frequency, entry.last_access,
                       entry.pinned, entry.num_tokens, entry.namespace, entry.slot)
    return fixed + entry.content_key


def decode_entry(value: bytes) -> Entry:
    if value[0] == 1:
        fields, slot, fixed_size = _META_V1.unpack_from(value), -1, _META_V1.size
    else:
        *fields, slot = _META.unpack_from(value)
        fixed_size = _META.size
    version, size_bytes, checksum, frequency, last_access, pinned, num_tokens, namespace = fields
    assert version in (1, _META_VERSION), f"unknown metadata version {version}"
    return Entry(namespace=namespace, content_key=bytes(value[fixed_size:]), num_tokens=num_tokens,
                 size_bytes=size_bytes, checksum=checksum, frequency=frequency, last_access=last_access,
                 pinned=bool(pinned), slot=slot)


def decode_meta_batch(keys: Sequence[bytes], fixed_parts: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Many (key, value[:_META.size]) at once: keys: uint8 [n, 32], metas: META_DTYPE [n]."""
    key_rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), DIGEST_SIZE)
    metas = np.frombuffer(b"".join(fixed_parts), dtype=META_DTYPE)
    assert len(metas) == len(keys), "every metadata value must hold the fixed part"
    return key_rows, metas


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
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=6, subdir=True, meminit=False)
        stale_readers = self._env.reader_check()
        if stale_readers:
            logger.info("cleared %d stale LMDB readers left by a dead process", stale_readers)
        self._blobs = self._env.open_db(BLOBS_DB)
        self._meta = self._env.open_db(META_DB)
        self._content = self._env.open_db(CONTENT_DB, dupsort=True)
        self._children = self._env.open_db(CHILDREN_DB)
        self._parents = self._env.open_db(PARENTS_DB)
        info_db = self._info = self._env.open_db(INFO_DB)
        self.environment_id = self._ensure_environment_id(info_db)
        self._ensure_meta_version(info_db)
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

    def _ensure_meta_version(self, info_db) -> None:
        """Version-1 metadata (no slot) gets slots 0..n-1 in key order, once, in one transaction."""
        with self._env.begin(write=True) as txn:
            if txn.get(META_VERSION_KEY, db=info_db) == bytes([_META_VERSION]):
                return
            old = [(key, decode_entry(value)) for key, value in txn.cursor(db=self._meta)]
            for slot, (key, entry) in enumerate(old):
                txn.put(key, encode_entry(dataclasses.replace(entry, slot=slot)), db=self._meta)
            txn.put(META_VERSION_KEY, bytes([_META_VERSION]), db=info_db)
        if old:
            logger.info("gave %d chunks written by an older daemon a slot in their metadata", len(old))

    def info_value(self, key: bytes, create: Callable[[], bytes]) -> bytes:
        """The value under `key` in the info DB; create() is stored there first when there is none."""
        with self._write_lock, self._gate.shared(), self._env.begin(write=True, db=self._info) as txn:
            existing = txn.get(key)
            if existing is not None:
                return bytes(existing)
            value = create()
            txn.put(key, value)
            return value

    def info_items(self, prefix: bytes) -> dict[bytes, bytes]:
        """Every info DB item whose key starts with `prefix`, the prefix cut off."""
        with self._gate.shared(), self._env.begin(db=self._info) as txn:
            cursor = txn.cursor()
            found = {}
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    found[key[len(prefix):]] = value
            return found

    def put_info(self, items: dict[bytes, bytes]) -> None:
        with self._write_lock:
            while True:
                try:
                    with self._gate.shared(), self._env.begin(write=True, db=self._info) as txn:
                        for key, value in items.items():
                            txn.put(key, value)
                    return
                except lmdb.MapFullError:
                    self._grow_map(sum(len(key) + len(value) for key, value in items.items()))
                except lmdb.Error as error:
                    raise self._write_error(error, sum(len(key) + len(value) for key, value in items.items())) from error

    @property
    def map_size(self) -> int:
        return self._env.info()["map_size"]

    def num_entries(self) -> int:
        with self._gate.shared(), self._env.begin() as txn:
            return txn.stat(self._meta)["entries"]

    def load_entries(self) -> dict[ChunkKey, Entry]:
        with self._gate.shared(), self._env.begin(db=self._meta) as txn:
            return {ChunkKey(key): decode_entry(value) for key, value in txn.cursor()}

    def scan_meta(self, batch_size: int = 8192) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every entry's key and fixed metadata, decode_meta_batch'ed batch_size at a time, in
        one read transaction (a snapshot: writes meanwhile are not seen)."""
        with self._gate.shared(), self._env.begin(db=self._meta) as txn:
            cursor = txn.cursor()
            while True:
                keys: list[bytes] = []
                fixed_parts: list[bytes] = []
                for key, value in cursor.iternext():
                    keys.append(key)
                    fixed_parts.append(value[:_META.size])
                    if len(keys) == batch_size:
                        break
                if not keys:
                    return
                yield decode_meta_batch(keys, fixed_parts)
                # iternext() yields the current entry before stepping: step past the last one read.
                if len(keys) < batch_size or not cursor.next():
                    return

    def held_page(self, after: bytes, limit: int) -> list[HeldChunk]:
        """Up to `limit` stored chunks with keys after `after` (b"": from the first), in key order, each with
        its parent key from the continuation index, in one short read transaction."""
        with self._gate.shared(), self._env.begin() as txn:
            cursor = txn.cursor(db=self._meta)
            positioned = cursor.set_range(after) if after else cursor.first()
            if positioned and cursor.key() == after:
                positioned = cursor.next()
            page: list[HeldChunk] = []
            while positioned and len(page) < limit:
                key = cursor.key()
                parent = txn.get(key, db=self._parents)
                page.append((ChunkKey(key), decode_entry(cursor.value()), b"" if parent is None else parent))
                positioned = cursor.next()
            return page

    def get_entries(self, keys: Sequence[bytes]) -> list[Entry | None]:
        """Each key's metadata as committed, None when absent (one read txn for all)."""
        with self._gate.shared(), self._env.begin(db=self._meta) as txn:
            return [None if (value := txn.get(key)) is None else decode_entry(value) for key in keys]

    def holding(self, keys: Sequence[bytes], namespace: bytes) -> list[bool]:
        """Whether each key is stored in `namespace`, reading only the namespace field."""
        end = _NAMESPACE_OFFSET + DIGEST_SIZE
        with self._gate.shared(), self._env.begin(db=self._meta, buffers=True) as txn:
            return [(value := txn.get(key)) is not None and value[_NAMESPACE_OFFSET:end] == namespace
                    for key in keys]

    def read_chunk(self, key: ChunkKey, copy_out: Callable[[Entry, memoryview], T]) -> T | None:
        """copy_out(metadata, view of the blob) inside one short read txn; it must copy what it keeps."""
        with self._gate.shared(), self._env.begin(buffers=True) as txn:
            meta = txn.get(key, db=self._meta)
            view = None if meta is None else txn.get(key, db=self._blobs)
            return None if view is None else copy_out(decode_entry(bytes(meta)), memoryview(view))

    def content_matches(self, content_keys: Sequence[bytes]) -> list[list[ChunkKey]]:
        """For each content key, the prefix keys stored with it (one read txn for all)."""
        with self._gate.shared(), self._env.begin(db=self._content) as txn:
            cursor = txn.cursor()
            return [[ChunkKey(key) for key in cursor.iternext_dup()] if cursor.set_key(content_key) else []
                    for content_key in content_keys]

    def children(self, parent: bytes) -> list[tuple[ChunkKey, bytes]]:
        """(child key, packed token ids) of every chunk indexed as a continuation of parent."""
        with self._gate.shared(), self._env.begin(db=self._children) as txn:
            cursor = txn.cursor()
            found = []
            if cursor.set_range(parent):
                for key, value in cursor:
                    if key[:DIGEST_SIZE] != parent:
                        break
                    found.append((ChunkKey(key[DIGEST_SIZE:]), bytes(value)))
            return found

    def read_blob(self, key: ChunkKey, copy_out: Callable[[memoryview], T]) -> T | None:
        """copy_out(view of the blob) inside a short read txn; it must copy what it keeps."""
        with self._gate.shared(), self._env.begin(db=self._blobs, buffers=True) as txn:
            view = txn.get(key)
            return None if view is None else copy_out(memoryview(view))

    def write(self, puts: Sequence[Put] = (), updates: Sequence[tuple[ChunkKey, Entry]] = (),
              deletes: Sequence[tuple[ChunkKey, Entry]] = (), continuations: Sequence[Continuation] = (),
              unindexed: Sequence[ChunkKey] = ()) -> None:
        """Puts new chunks, rewrites metadata, deletes chunks, indexes continuations (of chunks put now) and
        drops chunks from the continuation index (unindexed; their blobs stay): all in one transaction."""
        with self._write_lock:
            while True:
                try:
                    with self._gate.shared(), self._env.begin(write=True) as txn:
                        self._apply(txn, puts, updates, deletes)
                        self._apply_continuations(txn, [key for key, _ in deletes] + list(unindexed),
                                                  continuations)
                    return
                except lmdb.MapFullError:
                    self._grow_map(sum(len(blob) for _, _, blob in puts))
                except lmdb.Error as error:
                    raise self._write_error(error, sum(len(blob) for _, _, blob in puts)) from error

    # LMDB writes a transaction's pages with write(2) and its meta page last: on a full disk the commit fails
    # (ENOSPC, or EIO from some file systems) and the last committed state stays; the map file is sparse, so
    # the disk can fill long before the map does.
    _DISK_HEADROOM = 16 << 20

    def _write_error(self, error: lmdb.Error, bytes_written: int) -> DiskFull | WriteFailed:
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            free = None
        if free is not None and free < bytes_written + self._DISK_HEADROOM:
            return DiskFull(f"the disk under --data-dir {self.path} has {free} bytes free, too few for this write "
                            f"({bytes_written} bytes of chunks): nothing of it was stored, what was stored before is "
                            f"intact; free space there or lower --max-bytes ({error})")
        return WriteFailed(f"LMDB could not write to {self.path}: {error}; nothing of this write was stored, "
                           f"what was stored before is intact")

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

    def _apply_continuations(self, txn, removed: Sequence[ChunkKey], continuations: Sequence[Continuation]) -> None:
        for child in removed:
            parent = txn.get(child, db=self._parents)
            if parent is not None:
                txn.delete(bytes(parent) + child, db=self._children)
                txn.delete(child, db=self._parents)
        for child, parent, token_ids in continuations:
            txn.put(parent + child, token_ids, db=self._children)
            txn.put(child, parent, db=self._parents)

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
