"""The daemon's transport limits: --max-message-bytes and --max-concurrent-streams, from flags to the wire."""
from __future__ import annotations

import threading

import grpc
import pytest
from kvboost.v1 import cache_pb2, cache_pb2_grpc

from cache_daemon.config import DEFAULT_MAX_MESSAGE_BYTES, parse_config
from tests.daemon_support import (NAMESPACE, digest, fetch_chunks, make_chunk, rpc_error, running_daemon,
                                  store_chunks, store_frames)


def test_flags_and_environment_set_the_limits() -> None:
    config = parse_config(["--data-dir", "x"], environ={})
    assert (config.max_message_bytes, config.max_concurrent_streams) == (DEFAULT_MAX_MESSAGE_BYTES, 0)
    environ = {"KVBOOST_MAX_MESSAGE_BYTES": "4M", "KVBOOST_MAX_CONCURRENT_STREAMS": "8"}
    config = parse_config(["--data-dir", "x"], environ=environ)
    assert (config.max_message_bytes, config.max_concurrent_streams) == (4 << 20, 8)
    config = parse_config(["--data-dir", "x", "--max-message-bytes", "3M", "--max-concurrent-streams", "2"],
                          environ=environ)
    assert (config.max_message_bytes, config.max_concurrent_streams) == (3 << 20, 2)


@pytest.mark.parametrize("argv, message", [
    (["--max-message-bytes", "1M"], "--max-message-bytes must be at least 2M"),
    (["--max-concurrent-streams", "-1"], "--max-concurrent-streams must be >= 0"),
])
def test_bad_limits_exit_with_a_usage_message(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--data-dir", "x", *argv], environ={})
    assert message in capsys.readouterr().err


def test_a_message_over_the_limit_is_resource_exhausted_and_whole_frames_still_pass(tmp_path) -> None:
    with running_daemon(tmp_path / "lmdb", max_message_bytes=2 << 20) as daemon:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            # 3 MiB of keys in one Lookup: refused by gRPC before the servicer runs.
            too_big = cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[bytes(32)] * (3 << 15))
            error = rpc_error(stub.Lookup, too_big, timeout=10)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            # A data frame holds 1 MiB: a 3 MiB chunk is three frames, each under the limit.
            chunk = make_chunk("three frames", 3 << 20)
            assert store_chunks(stub, [chunk], timeout=30).stored == 1
            [fetched] = fetch_chunks(stub, [chunk.key], timeout=30)
            assert fetched.blob == chunk.blob and fetched.num_data_frames == 3


def test_calls_beyond_the_stream_limit_wait_for_a_free_stream(tmp_path) -> None:
    with running_daemon(tmp_path / "lmdb", max_concurrent_streams=1) as daemon:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            stub.Stats(cache_pb2.CacheStatsRequest(), timeout=10)  # connected, the server's settings known
            chunk = make_chunk("held open", 1000)
            release = threading.Event()

            def held_frames():
                yield from store_frames([chunk])
                release.wait(timeout=30)  # the Store stream stays open until released

            store = stub.Store.future(held_frames(), timeout=30)
            # The one stream is taken: another call on this connection waits, here past its deadline.
            error = rpc_error(stub.Lookup, cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[digest(1)]),
                              timeout=1)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            release.set()
            assert store.result(timeout=30).stored == 1
            # The stream is free again: calls go through.
            assert stub.Lookup(cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[chunk.key]),
                               timeout=10).prefix_run == 1
