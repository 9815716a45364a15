"""--l2 addresses: schemes, cluster seed lists, credentials, and the reasons for refusing bad ones."""
from __future__ import annotations

import re

import pytest

from cache_daemon.config import parse_config
from cache_daemon.l2.address import L2Address, parse_l2_address


def test_single_node_with_password_and_db():
    address = parse_l2_address("redis://:s3cret@10.0.0.5:6380/2")
    assert address == L2Address(nodes=(("10.0.0.5", 6380),), password="s3cret", db=2)
    assert address.redacted() == "redis://10.0.0.5:6380/2"  # no password in logs or Stats


def test_cluster_seed_nodes_tls_and_password_from_a_file():
    address = parse_l2_address("rediss-cluster://a:7000,b:7001,[::1]:7002", password="from file")
    assert address.nodes == (("a", 7000), ("b", 7001), ("::1", 7002))
    assert (address.cluster, address.tls, address.password) == (True, True, "from file")
    assert parse_l2_address("redis://user:inurl@h:1", password="file").password == "inurl"


@pytest.mark.parametrize("text, reason", [
    ("http://h:1", "expected redis://"),
    ("redis://h1:1,h2:2", "several hosts need redis-cluster"),
    ("redis://h", "is not host:port"),
    ("redis://h:70000", "is not host:port"),
    ("redis-cluster://h:1/3", "database 0 only"),
    ("redis://h:1/x", "database number"),
])
def test_bad_addresses_say_why(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_l2_address(text)


def test_daemon_flags_and_environment(tmp_path, capsys):
    config = parse_config(["--data-dir", str(tmp_path), "--l2", "redis-cluster://h:1,h:2", "--l2-write", "sync",
                           "--l2-key-file", "l2.key"], environ={})
    assert (config.l2_write, config.num_l2_wait_replicas) == ("sync", 1)  # a cluster write waits for a replica
    config = parse_config(["--data-dir", str(tmp_path)], environ={"KVBOOST_L2": "redis://h:1",
                                                                   "KVBOOST_L2_KEY_FILE": "l2.key"})
    assert (config.l2, config.num_l2_wait_replicas, str(config.l2_key_file)) == ("redis://h:1", 0, "l2.key")
    with pytest.raises(SystemExit):
        parse_config(["--data-dir", str(tmp_path), "--l2", "redis://nohost"], environ={})
    assert "is not host:port" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--l2", "redis://h:1"], "--l2 needs --l2-key-file .* secrets.token_hex"),
    (["--l2", "redis://h:1", "--l2-key-file", "k", "--tenants-file", "t.json"],
     "--tenants-file with --l2 needs --tenancy-secret-file"),
    (["--l2", "redis://h:1", "--l2-key-file", "k", "--l2-tls-ca-file", "ca.pem"], "need a rediss:// .*address"),
])
def test_l2_without_its_keys_refuses_to_start_and_says_how_to_fix_it(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_config(["--data-dir", str(tmp_path), *flags], environ={})
    assert re.search(message, capsys.readouterr().err)
