"""Reads blobs straight from the cache daemon's LMDB environment on the same host (read-only, zero-copy).

The only module of the service that imports lmdb. The daemon stays the only writer; this process
opens the environment read-only next to it, as LMDB allows. Blobs come back as views into the memory
map, valid until the fetch iterator is closed (LMDB keeps a read-only transaction's values in place until it ends); the reader's transaction keeps the pages of
its snapshot from being reused meanwhile, so an entry evicted or rewritten after Lookup reads as a miss
or as the snapshot's bytes, never as pages being overwritten. That guarantee needs the lock file: a reader
the writer cannot see may walk B-tree pages the writer is recycling, so the environment is never read
without it (a read-only mount, or a reader whose PID collides with the writer's in another PID namespace,
is refused, and the caller streams blobs over gRPC instead).
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Iterator

import lmdb

logger = logging.getLogger(__name__)

# The daemon's layout (cache_daemon/store.py, DescribeReply.blob_db_version = 1).
BLOBS_DB = b"blobs"
INFO_DB = b"info"
ENVIRONMENT_ID_KEY = b"environment_id"
SUPPORTED_BLOB_DB_VERSION = 1


class LocalReadUnavailable(OSError):
    """The environment cannot be opened here, or it is not the one the daemon described."""


class LmdbBlobReader:
    """Read-only view of one daemon's environment; thread-safe (one read transaction per fetch)."""

    def __init__(self, data_dir: str | Path, environment_id: bytes, blob_db_version: int = 1) -> None:
        """Raises LocalReadUnavailable when the directory cannot be opened or holds another environment."""
        if blob_db_version != SUPPORTED_BLOB_DB_VERSION:
            raise LocalReadUnavailable(f"blob DB version {blob_db_version} is not supported (this reader: 1)")
        path = Path(data_dir)
        self.path = path
        try:
            self._env = _open(path)
        except lmdb.Error as error:
            raise LocalReadUnavailable(f"cannot open the LMDB environment at {path} with its lock file: {error}") from error
        self._resize_lock = threading.Lock()
        try:
            # The first read transaction registers this process in lock.mdb's reader table, by PID.
            self._env.begin().abort()
        except lmdb.Error as error:
            self._env.close()
            raise LocalReadUnavailable(f"cannot register as a reader in {path}/lock.mdb ({error}); "
                                       f"unlocked reads are unsafe") from error
        try:
            self._blobs = self._env.open_db(BLOBS_DB, create=False)
            info = self._env.open_db(INFO_DB, create=False)
            with self._env.begin(db=info) as txn:
                found = txn.get(ENVIRONMENT_ID_KEY)
        except lmdb.Error as error:
            self._env.close()
            raise LocalReadUnavailable(f"{path} holds no cache daemon environment: {error}") from error
        if found is None or bytes(found) != environment_id:
            self._env.close()
            raise LocalReadUnavailable(f"{path} holds another environment than the daemon described")

    def fetch(self, keys: list[bytes]) -> Iterator[tuple[bytes, memoryview | bytes | None]]:
        """(key, blob) in order; None for a key that is not stored. A memoryview is valid until this iterator is closed."""
        try:
            txn = self._begin()
        except lmdb.Error as error:
            raise LocalReadUnavailable(f"cannot read {self.path}: {error}") from error
        try:
            for key in keys:
                try:
                    view = txn.get(key, db=self._blobs)
                except lmdb.Error as error:
                    raise LocalReadUnavailable(f"cannot read {self.path}: {error}") from error
                yield key, None if view is None else memoryview(view)
        finally:
            txn.abort()

    def _begin(self):
        try:
            return self._env.begin(buffers=True)
        except lmdb.MapResizedError:
            # The daemon grew its map since this process mapped it: adopt the new size, then read.
            with self._resize_lock:
                self._env.set_mapsize(0)
            return self._env.begin(buffers=True)

    def close(self) -> None:
        self._env.close()


def _open(path: Path):
    # readonly: never writes data; lock: readers registered in lock.mdb, so the writer keeps their pages;
    # max_dbs: room for the daemon's named DBs. LMDB adopts the file's map size.
    return lmdb.open(str(path), readonly=True, lock=True, max_dbs=8, subdir=True, create=False)
