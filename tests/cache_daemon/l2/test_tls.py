"""rediss:// with a private CA and client certificates, against a real redis-server with --tls-port."""
from __future__ import annotations

import shutil
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest
from kvboost.v1 import cache_pb2

from cache_daemon.entry import ChunkKey
from cache_daemon.l2.address import parse_l2_address
from cache_daemon.l2.record_auth import parse_keyring
from cache_daemon.l2.redis_tier import L2Unavailable, RedisTier
from cache_daemon.l2.tls import L2TlsFiles
from tests.conftest import pick_free_port
from tests.daemon_support import TEST_L2_KEY, cache_stub, fetch_chunks, make_chunk, running_daemon, store_chunks
from tests.redis_support import RedisNode, requires_redis

OPENSSL = shutil.which("openssl")
pytestmark = [requires_redis, pytest.mark.skipif(OPENSSL is None, reason="the openssl CLI makes the test's certificates")]


def openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run([OPENSSL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"openssl {' '.join(args)} failed:\n{done.stderr}"


def make_certificates(folder: Path, ca_name: str = "ca") -> dict[str, Path]:
    """A private CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""
    folder.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", f"{ca_name}.key", "-out", f"{ca_name}.pem", "-days", "2",
            "-subj", f"/CN={ca_name}", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvboost {name}", cwd=folder)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca_name}.pem", "-CAkey", f"{ca_name}.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext", cwd=folder)
    files = {name: folder / name for name in ("server.pem", "server.key", "client.pem", "client.key")}
    return {"ca.pem": folder / f"{ca_name}.pem", **files}


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """redis-server with a plain port (for the readiness PING) and a TLS port that wants client certificates."""
    folder = tmp_path_factory.mktemp("redis-tls")
    certificates = make_certificates(folder / "certs")
    tls_port = pick_free_port()
    node = RedisNode(pick_free_port(), folder / "data", cluster=False, extra=(
        "--tls-port", str(tls_port), "--tls-cert-file", str(certificates["server.pem"]),
        "--tls-key-file", str(certificates["server.key"]), "--tls-ca-cert-file", str(certificates["ca.pem"]),
        "--tls-auth-clients", "yes"))
    node.start()
    try:
        yield f"rediss://127.0.0.1:{tls_port}", certificates, folder
    finally:
        node.stop()


def tier(url: str, tls_files: L2TlsFiles) -> RedisTier:
    return RedisTier(parse_l2_address(url), parse_keyring(TEST_L2_KEY), timeout_s=2.0, tls_files=tls_files)


def test_two_daemons_share_chunks_over_tls_with_a_private_ca_and_client_certificates(tmp_path, tls_redis):
    url, certificates, _ = tls_redis
    fields = dict(l2=url, l2_tls_ca_file=certificates["ca.pem"], l2_tls_cert_file=certificates["client.pem"],
                  l2_tls_key_file=certificates["client.key"])
    chunk = make_chunk("over tls", 5000)
    with ExitStack() as stack:
        host_a, host_b = (stack.enter_context(running_daemon(tmp_path / name, **fields)) for name in "ab")
        with cache_stub(host_a.address) as stub_a, cache_stub(host_b.address) as stub_b:
            store_chunks(stub_a, [chunk])
            assert host_a.cache.drain_writes(10)
            assert host_a.cache.l2_stats().writes == 1 and not host_a.cache.l2.degraded
            reply = stub_b.Lookup(cache_pb2.LookupRequest(namespace=chunk.namespace, prefix_keys=[chunk.key]))
            assert reply.prefix_run == 1, "B found A's chunk through Redis over TLS"
            assert fetch_chunks(stub_b, [chunk.key])[0].blob == chunk.blob


def test_without_the_private_ca_redis_is_not_trusted(tls_redis):
    url, certificates, _ = tls_redis
    untrusting = tier(url, L2TlsFiles(cert_file=certificates["client.pem"], key_file=certificates["client.key"]))
    with pytest.raises(L2Unavailable, match="certificate verify failed"):
        untrusting.get([ChunkKey(b"k" * 32)])


def test_a_server_signed_by_another_ca_is_refused(tls_redis):
    url, certificates, folder = tls_redis
    other = make_certificates(folder / "other", ca_name="other-ca")
    wrong_ca = tier(url, L2TlsFiles(other["ca.pem"], certificates["client.pem"], certificates["client.key"]))
    with pytest.raises(L2Unavailable, match="certificate verify failed"):
        wrong_ca.get([ChunkKey(b"k" * 32)])


def test_without_a_client_certificate_redis_refuses_the_daemon(tls_redis):
    url, certificates, _ = tls_redis
    anonymous = tier(url, L2TlsFiles(ca_file=certificates["ca.pem"]))
    with pytest.raises(L2Unavailable):
        anonymous.get([ChunkKey(b"k" * 32)])
    trusted = tier(url, L2TlsFiles(certificates["ca.pem"], certificates["client.pem"], certificates["client.key"]))
    assert trusted.get([ChunkKey(b"k" * 32)]) == [None]  # the same call with the certificate: a plain miss
