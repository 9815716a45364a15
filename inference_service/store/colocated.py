"""ColocatedStore: Lookup and Store through the daemon, Fetch from its memory map when this host can open it."""
from __future__ import annotations

import logging
import threading
import time
from typing import Iterator

from inference_service.store.grpc_store import GrpcChunkStore
from inference_service.store.lmdb_reader import LmdbBlobReader, LocalReadUnavailable
from inference_service.store.protocol import AfterRun, ContinuationQuery, StoreItem, StoreLookup, StoreUnavailable

logger = logging.getLogger(__name__)

LOCAL_READ_MODES = ("auto", "on", "off")


class LentBlobs:
    """A fetch whose blobs are views into shared memory, valid until the fetch is closed (LMDB keeps a read
    transaction's values in place until it ends): the reader places them before closing it, and must not read
    ahead on another thread (the iterator is not thread-safe)."""

    lent = True

    def __init__(self, blobs: Iterator[tuple[bytes, memoryview | bytes | None]]) -> None:
        self._blobs = blobs

    def __iter__(self) -> Iterator[tuple[bytes, memoryview | bytes | None]]:
        return self._blobs

    def close(self) -> None:
        self._blobs.close()


class ColocatedStore:
    """The daemon's gRPC store, with Fetch served from the daemon's LMDB environment on this host.

    The daemon stays the only writer and keeps counting hits (Lookup) and evicting (Store). Discovery is
    automatic: Describe names the environment's directory and identity; the reader is used only when it
    opens that directory and finds the same identity inside. mode "auto" falls back to the gRPC stream
    (and tries again every `retry_interval_s`), "on" refuses to run without local reads (see `check`).
    """

    def __init__(self, remote: GrpcChunkStore, mode: str = "auto", retry_interval_s: float = 30.0) -> None:
        assert mode in ("auto", "on"), f"local read mode must be auto or on here, got {mode!r}"
        self.remote = remote
        self.mode = mode
        self._retry_interval_s = retry_interval_s
        self._reader: LmdbBlobReader | None = None
        self._next_attempt = 0.0
        self._lock = threading.Lock()
        self._fallback_logged = False
        self.num_stream_fetches = 0  # fetches served by the gRPC stream because the map could not be opened

    @property
    def degraded(self) -> bool:
        return self.remote.degraded

    @property
    def address(self) -> str:
        return self.remote.address

    @property
    def reads_locally(self) -> bool:
        return self._reader is not None

    @property
    def read_mode(self) -> str:
        """"locked_map": blobs from the daemon's memory map, registered in its lock file; "stream": over Fetch."""
        return "locked_map" if self._reader is not None else "stream"

    def lookup(self, namespace: bytes, prefix_keys: list[bytes], content_keys: list[bytes] | None = None,
               partial_keys: list[bytes] | None = None, continuation: ContinuationQuery | None = None,
               after_run: AfterRun | None = None) -> StoreLookup:
        return self.remote.lookup(namespace, prefix_keys, content_keys, partial_keys, continuation, after_run)

    def store(self, items: list[StoreItem]) -> int:
        return self.remote.store(items)

    def unpin(self, keys: list[bytes]) -> int:
        return self.remote.unpin(keys)

    def report_corrupt(self, keys: list[bytes]) -> None:
        self.remote.report_corrupt(keys)

    def fetch(self, keys: list[bytes]):
        """Blobs from the memory map (LentBlobs) when the environment is open here, else the gRPC stream."""
        reader = self._reader or self._maybe_discover()
        if reader is None:
            self.num_stream_fetches += 1
            return self.remote.fetch(keys)
        return LentBlobs(self._read_locally(reader, keys))

    def _read_locally(self, reader: LmdbBlobReader, keys: list[bytes]):
        """The map's blobs in order; from the first key the map misses, the rest over the Fetch stream: a
        Lookup answers chunks still arriving from L2 as hits, this read's snapshot predates their
        promotion, and the daemon's Fetch waits for each (a chunk that never arrives is a miss there)."""
        try:
            blobs = reader.fetch(keys)
            try:
                for index, (key, blob) in enumerate(blobs):
                    if blob is None:
                        self.num_stream_fetches += 1
                        yield from self.remote.fetch(keys[index:])
                        return
                    yield key, blob
            finally:
                blobs.close()
        except LocalReadUnavailable as error:
            with self._lock:
                if self._reader is reader:
                    self._reader = None  # the gRPC stream serves from now on; discovery retries later
            logger.warning("local read of the daemon's environment failed, falling back to gRPC: %s", error)
            raise StoreUnavailable(f"local read failed: {error}") from error

    def check(self) -> bool:
        """Start-up: probes the daemon and discovers its environment. Raises LocalReadUnavailable in mode "on"
        when local reads cannot be set up."""
        answers = self.remote.check()
        if self._maybe_discover(force=True) is None and self.mode == "on":
            raise LocalReadUnavailable(f"--cache-local-read=on, but the environment of the daemon at {self.address} "
                                       f"cannot be opened from this host (see the log)")
        return answers

    def close(self) -> None:
        with self._lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        self.remote.close()

    def _maybe_discover(self, force: bool = False) -> LmdbBlobReader | None:
        with self._lock:
            if self._reader is not None or (not force and time.monotonic() < self._next_attempt):
                return self._reader
            self._next_attempt = time.monotonic() + self._retry_interval_s
            try:
                described = self.remote.describe()
                self._reader = LmdbBlobReader(described.data_dir, described.environment_id,
                                              described.blob_db_version)
            except (StoreUnavailable, LocalReadUnavailable) as error:
                self._maybe_log_fallback(error)
                return None
            logger.info("cache blobs are read from the daemon's LMDB environment at %s (locked map)",
                        described.data_dir)
            self._fallback_logged = False  # a later fallback is news again
            return self._reader

    def _maybe_log_fallback(self, error: Exception) -> None:
        # Once per fallback: discovery retries every retry_interval_s and would repeat the same line.
        if self._fallback_logged:
            logger.debug("cache blobs still come over gRPC from %s: %s", self.address, error)
            return
        self._fallback_logged = True
        logger.warning("cache blobs come over gRPC from %s (read mode: stream): %s", self.address, error)
