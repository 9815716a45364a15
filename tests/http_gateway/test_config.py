"""GatewayConfig: flags over KVBOOST_* environment over defaults; --help explains every flag."""
from __future__ import annotations

import pytest

from http_gateway.config import GatewayConfig, build_parser, parse_config


def test_defaults_bind_loopback_8000_and_reach_the_service_default():
    config = parse_config([], environ={})
    assert config == GatewayConfig() and config.listen == "127.0.0.1:8000"
    assert (config.host, config.port, config.service_addr) == ("127.0.0.1", 8000, "127.0.0.1:50051")


def test_environment_then_flags():
    environ = {"KVBOOST_GATEWAY_LISTEN": "127.0.0.1:9000", "KVBOOST_ADDRESS": "10.0.0.1:1", "KVBOOST_TOKEN": "t",
               "KVBOOST_SERVICE_TLS": "1", "KVBOOST_GATEWAY_TIMEOUT": "5"}
    config = parse_config([], environ=environ)
    assert (config.listen, config.service_addr, config.token, config.tls, config.timeout_s) == (
        "127.0.0.1:9000", "10.0.0.1:1", "t", True, 5.0)
    assert parse_config(["--timeout", "7", "--no-tls"], environ=environ).timeout_s == 7.0


def test_token_file_is_read_and_secrets_are_not_printed(tmp_path):
    (tmp_path / "token").write_text("secret\n")
    config = parse_config(["--token-file", str(tmp_path / "token")], environ={})
    assert config.service_token() == "secret"
    assert "secret" not in parse_config(["--token", "secret"], environ={}).describe()


@pytest.mark.parametrize("argv", [["--listen", "8000"], ["--token", "a", "--token-file", "b"], ["--tls-ca", "ca.pem"],
                                  ["--timeout", "0"], ["--default-max-tokens", "0"]])
def test_bad_values_exit_with_usage(argv):
    with pytest.raises(SystemExit):
        parse_config(argv, environ={})


def test_help_explains_every_flag():
    parser = build_parser({})
    for action in parser._actions:
        if action.dest != "help":
            assert action.help and "KVBOOST_" in action.help, f"{action.option_strings} lacks help or its variable"
