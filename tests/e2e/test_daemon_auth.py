"""A real daemon with a bearer token (and TLS): calls without the token are UNAUTHENTICATED."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvboost.v1 import cache_pb2, cache_pb2_grpc

from tests.certificates import make_certificate, requires_openssl
from tests.conftest import pick_free_port
from tests.daemon_support import NAMESPACE, digest, fetch_chunks, make_chunk, rpc_error, store_chunks, store_frames
from tests.e2e.daemon_process import start_daemon

pytestmark = pytest.mark.e2e

TOKEN = "e2e-token-0123456789"
GOOD = [("authorization", f"Bearer {TOKEN}")]


def calls_without_a_valid_token(stub: cache_pb2_grpc.CacheServiceStub, metadata) -> dict[str, grpc.StatusCode]:
    lookup = cache_pb2.LookupRequest(namespace=NAMESPACE, prefix_keys=[digest(1)])
    return {
        "Lookup": rpc_error(stub.Lookup, lookup, metadata=metadata).code(),
        "Fetch": rpc_error(stub.Fetch, cache_pb2.FetchRequest(keys=[digest(1)]), metadata=metadata).code(),
        "Store": rpc_error(stub.Store, iter(store_frames([make_chunk("x")])), metadata=metadata).code(),
        "Stats": rpc_error(stub.Stats, cache_pb2.CacheStatsRequest(), metadata=metadata).code(),
        "Delete": rpc_error(stub.Delete, cache_pb2.DeleteRequest(keys=[digest(1)]), metadata=metadata).code(),
        "Pin": rpc_error(stub.Pin, cache_pb2.PinRequest(keys=[digest(1)]), metadata=metadata).code(),
    }


def check_token_is_required(channel: grpc.Channel) -> None:
    stub = cache_pb2_grpc.CacheServiceStub(channel)
    for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
        codes = calls_without_a_valid_token(stub, metadata)
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    chunk = make_chunk("authorized", 2_000_000)
    assert store_chunks(stub, [chunk], metadata=GOOD).stored == 1
    assert fetch_chunks(stub, [chunk.key], metadata=GOOD)[0].blob == chunk.blob
    # Health stays open for orchestrators.
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def write_token(tmp_path: Path) -> Path:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    return token_file


def test_calls_without_the_token_are_unauthenticated(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port(), "--auth-token-file", str(write_token(tmp_path)))
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            check_token_is_required(channel)
    finally:
        daemon.terminate()
    assert "rejected a call to /kvboost.v1.CacheService/Lookup" in daemon.log()
    assert TOKEN not in daemon.log(), "the token is never logged"


@requires_openssl
def test_tls_with_a_token(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    daemon = start_daemon(tmp_path / "lmdb", pick_free_port(), "--auth-token-file", str(write_token(tmp_path)),
                          "--tls-cert", str(cert), "--tls-key", str(key), tls_root_cert=cert.read_bytes())
    try:
        with grpc.secure_channel(daemon.address, grpc.ssl_channel_credentials(cert.read_bytes())) as channel:
            check_token_is_required(channel)
        with grpc.insecure_channel(daemon.address) as channel:
            error = rpc_error(cache_pb2_grpc.CacheServiceStub(channel).Stats, cache_pb2.CacheStatsRequest(),
                              metadata=GOOD, timeout=5)
            assert error.code() == grpc.StatusCode.UNAVAILABLE, "plaintext is refused"
    finally:
        daemon.terminate()
