"""RouterConfig from flags and KVBOOST_ROUTER_* variables; bad values stop with a message naming the flag."""
from __future__ import annotations

import pytest

from router.config import ReplicaAddress, parse_config

TWO = ["--replica", "127.0.0.1:50051=127.0.0.1:50052", "--replica", "unix:/run/b.sock=10.0.0.2:50052"]


def test_replicas_policy_and_defaults_from_flags():
    config = parse_config(TWO + ["--policy", "round-robin"], environ={})
    assert config.replicas == (ReplicaAddress("127.0.0.1:50051", "127.0.0.1:50052"),
                               ReplicaAddress("unix:/run/b.sock", "10.0.0.2:50052"))
    assert (config.policy, config.listen, config.warm) == ("round-robin", "127.0.0.1:50050", "picked")


def test_the_environment_fills_what_flags_leave_out():
    environ = {"KVBOOST_ROUTER_REPLICAS": "a:1=b:2,c:3=d:4", "KVBOOST_ROUTER_POLICY": "least-loaded",
               "KVBOOST_ROUTER_LOAD_COST_TOKENS": "64"}
    config = parse_config([], environ=environ)
    assert [str(replica) for replica in config.replicas] == ["a:1=b:2", "c:3=d:4"]
    assert (config.policy, config.load_cost_tokens) == ("least-loaded", 64.0)
    # Flags win over the environment.
    assert parse_config(TWO, environ=environ).replicas[0].service == "127.0.0.1:50051"


@pytest.mark.parametrize("argv, message", [
    ([], "at least one --replica"),
    (["--replica", "127.0.0.1:50051"], "SERVICE_ADDR=DAEMON_ADDR"),
    (["--replica", "127.0.0.1:50051=nowhere"], "daemon address must be HOST:PORT"),
    (TWO[:2] * 2, "appears twice"),
    (TWO + ["--content-weight", "2"], "--content-weight"),
    (TWO + ["--tls-cert", "c.pem"], "--tls-cert and --tls-key"),
])
def test_bad_values_stop_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv, environ={})
    assert message in capsys.readouterr().err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"], environ={})
    text = capsys.readouterr().out
    flags = ["--replica", "--listen", "--policy", "--tokenizer", "--cache-tenant", "--content-weight",
             "--load-cost-tokens", "--warm", "--stats-interval", "--startup-timeout", "--metrics-port",
             "--max-message-bytes", "--auth-token-file", "--tls-cert", "--tls-key", "--replica-auth-token-file",
             "--replica-tls", "--replica-tls-ca", "--cache-auth-token-file", "--cache-tls", "--cache-tls-ca",
             "--log-level"]
    assert all(flag in text for flag in flags)
    assert text.count("KVBOOST_ROUTER_") >= len(flags)
