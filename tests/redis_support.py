"""Real redis-server processes on loopback for the L2 tests: one node, or a 3-primary/3-replica cluster."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
requires_redis = pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None,
                                    reason="redis-server / redis-cli not on PATH (apt-get install redis-server)")


@dataclass
class RedisNode:
    port: int
    data_dir: Path
    cluster: bool
    process: subprocess.Popen | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)

    def start(self) -> RedisNode:
        """Starts (or restarts, on the same dir: AOF and nodes.conf reloaded) and waits for PING."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
                   "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no",
                   "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lfu", *self.extra]
        if self.cluster:
            command += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0"]
        log = open(self.data_dir / "redis.log", "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 15
        while self.cli("PING").strip() != "PONG":
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} did not start:\n"
                                   f"{(self.data_dir / 'redis.log').read_text(errors='replace')}")
            time.sleep(0.05)
        return self

    def cli(self, *args: str) -> str:
        done = subprocess.run([REDIS_CLI, "-p", str(self.port), *args], capture_output=True, text=True, timeout=10)
        return done.stdout

    def kill(self) -> None:
        """kill -9: no AOF rewrite, no goodbye to the cluster."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


def pick_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port


@contextmanager
def redis_node(data_dir: Path, port: int | None = None) -> Iterator[RedisNode]:
    from tests.conftest import pick_free_port

    node = RedisNode(port or pick_free_port(), data_dir, cluster=False).start()
    try:
        yield node
    finally:
        node.stop()


@dataclass
class RedisCluster:
    nodes: list[RedisNode]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def primaries(self) -> list[RedisNode]:
        return [node for node in self.nodes if node.process and node.process.poll() is None
                and "role:master" in node.cli("INFO", "replication")]

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok, 3 primaries are up and every replica is in sync."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [node for node in self.nodes if node.process and node.process.poll() is None]
            replication = [node.cli("INFO", "replication") for node in live]
            replicas_synced = all("master_link_status:up" in info for info in replication if "role:slave" in info)
            if (all("cluster_state:ok" in node.cli("CLUSTER", "INFO") for node in live)
                    and len(self.primaries()) >= 3 and replicas_synced):
                return
            time.sleep(0.2)
        raise TimeoutError("the Redis cluster did not reach cluster_state:ok")


@contextmanager
def redis_cluster(data_dir: Path, num_nodes: int = 6) -> Iterator[RedisCluster]:
    """3 primaries and 3 replicas (redis-cli --cluster create ... --cluster-replicas 1)."""
    nodes = [RedisNode(pick_cluster_port(), data_dir / f"node{index}", cluster=True) for index in range(num_nodes)]
    try:
        for node in nodes:
            node.start()
        create = [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{node.port}" for node in nodes),
                  "--cluster-replicas", "1", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"cluster create failed:\n{done.stdout}\n{done.stderr}"
        cluster = RedisCluster(nodes)
        cluster.wait_ok()
        yield cluster
    finally:
        for node in nodes:
            node.stop()
