"""Daemon configuration: flags, KVBOOST_* environment defaults, validation."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from cache_daemon.config import DaemonConfig, parse_config, parse_size


def test_defaults_bind_loopback() -> None:
    config = parse_config([], environ={})
    assert config.listen == "127.0.0.1:50052" and config.is_loopback
    assert config.max_bytes == 1 << 30 and config.metrics_port == 0
    assert config.initial_map_size == 2 * config.max_bytes + (64 << 20)
    assert config.auth_token_file is None and config.tls_cert is None


def test_environment_fills_defaults_and_flags_win() -> None:
    environ = {"KVBOOST_DATA_DIR": "/tmp/kv", "KVBOOST_CACHE_LISTEN": "0.0.0.0:6000", "KVBOOST_MAX_BYTES": "2G",
               "KVBOOST_METRICS_PORT": "9100", "KVBOOST_AUTH_TOKEN_FILE": "/run/token",
               "KVBOOST_FREQUENCY_HALF_LIFE": "0"}
    config = parse_config([], environ=environ)
    assert config.data_dir == Path("/tmp/kv") and config.listen == "0.0.0.0:6000"
    assert config.max_bytes == 2 << 30 and config.metrics_port == 9100
    assert config.auth_token_file == Path("/run/token")
    assert config.half_life == math.inf and not config.is_loopback
    assert parse_config(["--max-bytes", "512M"], environ=environ).max_bytes == 512 << 20


@pytest.mark.parametrize("text, size", [("1000", 1000), ("64K", 64 << 10), ("1.5G", 3 << 29), ("8MiB", 8 << 20)])
def test_sizes_take_binary_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("argv", [["--max-bytes", "0"], ["--tls-cert", "cert.pem"], ["--listen", "nohost"],
                                  ["--max-bytes", "lots"]])
def test_bad_flags_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv, environ={})


@pytest.mark.parametrize("listen, loopback", [("127.0.0.1:1", True), ("localhost:1", True), ("[::1]:1", True),
                                              ("0.0.0.0:1", False), ("10.0.0.5:1", False)])
def test_loopback_detection(listen: str, loopback: bool) -> None:
    assert DaemonConfig(data_dir=Path("x"), listen=listen).is_loopback is loopback


def test_startup_logs_the_config_and_warns_when_exposed_without_auth(caplog) -> None:
    from cache_daemon.server import log_config

    with caplog.at_level(logging.INFO, logger="cache_daemon"):
        log_config(DaemonConfig(data_dir=Path("x")))
        assert [record.levelname for record in caplog.records] == ["INFO"]
        assert "max_bytes=1073741824" in caplog.records[0].getMessage()
        caplog.clear()
        log_config(DaemonConfig(data_dir=Path("x"), listen="0.0.0.0:50052"))
        assert [record.levelname for record in caplog.records] == ["INFO", "WARNING"]
        caplog.clear()
        log_config(DaemonConfig(data_dir=Path("x"), listen="0.0.0.0:50052", auth_token_file=Path("token")))
        assert [record.levelname for record in caplog.records] == ["INFO"]


@pytest.mark.parametrize("listen", ["unix:/run/kvboost/daemon.sock", "unix:///tmp/kv.sock", "unix:relative.sock"])
def test_a_unix_socket_listens_locally(listen) -> None:
    config = DaemonConfig(data_dir=Path("x"), listen=listen)
    assert config.is_loopback and config.host == "127.0.0.1"


@pytest.mark.parametrize("listen", ["unix:", "unix:///", "no-port", "host:port"])
def test_bad_listen_addresses_are_refused(listen) -> None:
    with pytest.raises(ValueError, match="HOST:PORT or unix:PATH|needs a path"):
        DaemonConfig(data_dir=Path("x"), listen=listen)
