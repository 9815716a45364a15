"""ColocatedStore: discovery through Describe, local fetches, fallbacks to the gRPC stream in auto and on modes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference_service.store.colocated import ColocatedStore
from inference_service.store.lmdb_reader import LocalReadUnavailable
from inference_service.store.protocol import StoreUnavailable
from tests.inference_service.store.test_lmdb_reader import KEY_A, Writer


class FakeRemote:
    """The daemon's gRPC store as ColocatedStore uses it: Describe, Fetch, Lookup, Store, health probe."""

    def __init__(self, data_dir: str = "", environment_id: bytes = b"", reachable: bool = True) -> None:
        self.described = SimpleNamespace(data_dir=data_dir, environment_id=environment_id, blob_db_version=1)
        self.reachable = reachable
        self.degraded = not reachable
        self.address = "127.0.0.1:1"
        self.calls: list[str] = []

    def describe(self):
        self.calls.append("describe")
        if not self.reachable:
            raise StoreUnavailable("daemon down")
        return self.described

    def fetch(self, keys):
        self.calls.append("fetch")
        return iter([(key, b"over grpc") for key in keys])

    def check(self) -> bool:
        return self.reachable

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture()
def writer(tmp_path):
    writer = Writer(tmp_path / "lmdb")
    writer.send("put", KEY_A, 10)
    yield writer
    writer.close()


def test_fetches_come_from_the_memory_map_once_discovered(writer, tmp_path):
    remote = FakeRemote(str(tmp_path / "lmdb"), writer.environment_id)
    store = ColocatedStore(remote, "auto")
    try:
        assert store.check() and store.reads_locally and store.read_mode == "locked_map"
        blobs = store.fetch([KEY_A])
        assert blobs.lent and [bytes(blob) for _, blob in blobs] == [b"a" * 10]
        assert remote.calls == ["describe"]
    finally:
        store.close()


def test_auto_falls_back_to_grpc_and_retries_discovery_later(tmp_path):
    remote = FakeRemote(str(tmp_path / "elsewhere"), b"\x01" * 16)  # a path this host cannot open
    store = ColocatedStore(remote, "auto", retry_interval_s=3600)
    assert store.check() and not store.reads_locally and store.read_mode == "stream"
    fetched = store.fetch([KEY_A])
    assert not getattr(fetched, "lent", False) and list(fetched) == [(KEY_A, b"over grpc")]
    store.fetch([KEY_A])
    assert remote.calls == ["describe", "fetch", "fetch"], "no new Describe before the retry interval"
    assert store.num_stream_fetches == 2


def test_the_fallback_to_the_stream_is_logged_once_however_often_discovery_retries(tmp_path, caplog):
    store = ColocatedStore(FakeRemote(str(tmp_path / "elsewhere"), b"\x01" * 16), "auto", retry_interval_s=0)
    with caplog.at_level("DEBUG", logger="inference_service.store.colocated"):
        store.check()
        for _ in range(3):
            list(store.fetch([KEY_A]))
    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "read mode: stream" in warnings[0].getMessage()
    assert store.num_stream_fetches == 3 and store.read_mode == "stream"


def test_auto_discovers_once_the_daemon_answers(writer, tmp_path):
    remote = FakeRemote(str(tmp_path / "lmdb"), writer.environment_id, reachable=False)
    store = ColocatedStore(remote, "auto", retry_interval_s=0)
    try:
        assert not store.check()
        remote.reachable = True
        assert [bytes(blob) for _, blob in store.fetch([KEY_A])] == [b"a" * 10]
        assert store.reads_locally
    finally:
        store.close()


def test_on_refuses_to_start_without_local_reads(tmp_path):
    store = ColocatedStore(FakeRemote(str(tmp_path / "elsewhere"), b"\x01" * 16), "on")
    with pytest.raises(LocalReadUnavailable, match="--cache-local-read=on"):
        store.check()


def test_a_failing_local_read_falls_back_for_later_fetches(writer, tmp_path, monkeypatch):
    remote = FakeRemote(str(tmp_path / "lmdb"), writer.environment_id)
    store = ColocatedStore(remote, "auto", retry_interval_s=3600)
    try:
        store.check()

        def broken(keys):
            raise LocalReadUnavailable("cannot read: I/O error")
            yield  # pragma: no cover

        monkeypatch.setattr(store._reader, "fetch", broken)
        with pytest.raises(StoreUnavailable, match="local read failed"):
            list(store.fetch([KEY_A]))
        assert not store.reads_locally and store.read_mode == "stream"
        assert list(store.fetch([KEY_A])) == [(KEY_A, b"over grpc")]
    finally:
        store.close()


def test_chunks_the_map_misses_come_over_the_fetch_stream_from_the_first_miss_on(writer, tmp_path):
    """A Lookup may answer chunks still arriving from L2; this read's snapshot predates them, so from the first
    key the map misses the rest come over Fetch (where the daemon waits for them, or answers a miss)."""
    remote = FakeRemote(str(tmp_path / "lmdb"), writer.environment_id)
    store = ColocatedStore(remote, "auto")
    arriving = [b"\x0b" * 32, b"\x0c" * 32]
    try:
        assert store.check()
        blobs = store.fetch([KEY_A, *arriving])
        assert [(key, bytes(blob)) for key, blob in blobs] == [
            (KEY_A, b"a" * 10), (arriving[0], b"over grpc"), (arriving[1], b"over grpc")]
        blobs.close()
        assert remote.calls == ["describe", "fetch"] and store.num_stream_fetches == 1
        assert store.reads_locally  # a miss is not a failed read: the map stays in use
    finally:
        store.close()
