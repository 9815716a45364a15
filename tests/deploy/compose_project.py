"""One `docker compose` project for tests and benchmarks: its own name, free loopback ports, health states."""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import pick_free_port
from tests.deploy.docker_engine import docker

ROOT = Path(__file__).resolve().parents[2]
L2_REPLICA_FILE = ROOT / "tests" / "deploy" / "compose.l2-replica.yaml"
PUBLISHED = ("DAEMON", "METRICS", "INFERENCE", "GATEWAY", "REDIS", "DAEMON_B", "INFERENCE_B")


@dataclass
class ComposeProject:
    name: str
    files: tuple[Path, ...] = (ROOT / "compose.yaml",)
    profiles: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # KVBOOST_PUBLISH_<NAME> -> host port on 127.0.0.1

    def __post_init__(self) -> None:
        # Free host ports, so a stack already running on the defaults (make up, a user's compose) is left alone.
        self.ports = {name: pick_free_port() for name in PUBLISHED}
        self.environment.update({f"KVBOOST_PUBLISH_{name}": str(port) for name, port in self.ports.items()})

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        files = [item for path in self.files for item in ("-f", str(path))]
        profiles = [item for profile in self.profiles for item in ("--profile", profile)]
        return docker("compose", "-p", self.name, *files, *profiles, *args, timeout=timeout, cwd=ROOT,
                      env={**os.environ, **self.environment})

    def up(self, *services: str, timeout_s: int = 300) -> float:
        """Starts the services (all by default; images must exist) and their dependencies, and waits until all
        are healthy; returns the seconds taken."""
        started = time.monotonic()
        self.compose("up", "--detach", "--no-build", "--wait", "--wait-timeout", str(timeout_s), *services,
                     timeout=timeout_s + 60)
        return time.monotonic() - started

    def down(self, volumes: bool = False) -> None:
        self.compose("down", "--timeout", "30", *(["--volumes"] if volumes else []))

    def states(self) -> dict[str, tuple[str, str]]:
        """service -> (state, health) of each of the project's containers ("" health: no health check)."""
        output = self.compose("ps", "--all", "--format", "json").stdout.strip()
        rows = json.loads(output) if output.startswith("[") else [json.loads(line) for line in output.splitlines()]
        return {row["Service"]: (row["State"], row.get("Health", "")) for row in rows}

    def container_pid(self, service: str) -> int:
        """The host PID of a service's main process."""
        container = self.compose("ps", "--quiet", service).stdout.strip()
        return int(docker("inspect", "--format", "{{.State.Pid}}", container).stdout)

    def volumes(self) -> list[str]:
        return docker("volume", "ls", "--quiet", "--filter", f"label=com.docker.compose.project={self.name}").stdout.split()

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service).stdout
