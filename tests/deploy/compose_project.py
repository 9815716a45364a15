"""One `docker compose` project for tests and benchmarks: its own name, free loopback ports, health states."""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from tests.conftest import pick_free_port
from tests.deploy.docker_engine import docker

ROOT = Path(__file__).resolve().parents[2]
L2_REPLICA_FILE = ROOT / "tests" / "deploy" / "compose.l2-replica.yaml"
PUBLISHED = ("DAEMON", "METRICS", "INFERENCE", "GATEWAY", "REDIS", "DAEMON_B", "INFERENCE_B", "ROUTER")
# The secret each published gRPC port checks (compose.yaml's secrets service makes them).
TOKEN_OF = {"DAEMON": "daemon.token", "DAEMON_B": "daemon.token", "INFERENCE": "service.token",
            "INFERENCE_B": "service.token", "ROUTER": "service.token"}


@dataclass
class ComposeProject:
    name: str
    files: tuple[Path, ...] = (ROOT / "compose.yaml",)
    profiles: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # KVBOOST_PUBLISH_<NAME> -> host port on 127.0.0.1
    # Tests: every health check probes this often (the same check, same retries and start period). compose.yaml's
    # 10 s suits a deployment; a test waits up to an interval per service in each depends_on chain for the
    # first probe (daemon, then service, then gateway). None: the files' own intervals.
    health_interval: str | None = None

    def __post_init__(self) -> None:
        # Free host ports, so a stack already running on the defaults (make up, a user's compose) is left alone.
        self.ports = {name: pick_free_port() for name in PUBLISHED}
        self.environment.update({f"KVBOOST_PUBLISH_{name}": str(port) for name, port in self.ports.items()})
        if "OMP_NUM_THREADS" in os.environ:  # the test run's share of the cores (tests/conftest.py), per replica
            self.environment.setdefault("KVBOOST_THREADS", os.environ["OMP_NUM_THREADS"])
        self._health_override: Path | None = None

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def secret(self, name: str) -> str:
        """A file of the stack's kvboost-secrets volume (daemon.token, service.token, gateway.key), read
        through the running inference service, which mounts it."""
        return self.compose("exec", "-T", "inference", "cat", f"/secrets/{name}", timeout=60).stdout.strip()

    def channel(self, name: str) -> grpc.Channel:
        """A channel to a published gRPC port that sends the token that port checks."""
        token = self.secret(TOKEN_OF[name])
        return grpc.intercept_channel(grpc.insecure_channel(self.address(name)), _BearerToken(token))

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        paths = [*self.files, *([self._health_file()] if self.health_interval else [])]
        files = [item for path in paths for item in ("-f", str(path))]
        profiles = [item for profile in self.profiles for item in ("--profile", profile)]
        return docker("compose", "-p", self.name, *files, *profiles, *args, timeout=timeout, cwd=ROOT,
                      env={**os.environ, **self.environment})

    def _health_file(self) -> Path:
        """An override file giving every service with a health check in `files` the interval `health_interval`."""
        if self._health_override is None:
            services = {name for path in self.files
                        for name, service in (yaml.safe_load(path.read_text()).get("services") or {}).items()
                        if "healthcheck" in service}
            override = {"services": {name: {"healthcheck": {"interval": self.health_interval}}
                                     for name in sorted(services)}}
            handle, name = tempfile.mkstemp(prefix=f"{self.name}-health-", suffix=".yaml")
            with os.fdopen(handle, "w") as file:
                yaml.safe_dump(override, file)
            self._health_override = Path(name)
        return self._health_override

    def up(self, *services: str, timeout_s: int = 300) -> float:
        """Starts the services (all by default; images must exist) and their dependencies, and waits until all
        are healthy; returns the seconds taken."""
        started = time.monotonic()
        self.compose("up", "--detach", "--no-build", "--wait", "--wait-timeout", str(timeout_s), *services,
                     timeout=timeout_s + 60)
        return time.monotonic() - started

    def down(self, volumes: bool = False) -> None:
        self.compose("down", "--timeout", "30", *(["--volumes"] if volumes else []))
        if volumes and self._health_override is not None:  # the project's last call (a later one writes it again)
            self._health_override.unlink(missing_ok=True)
            self._health_override = None

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


def remove_stale_projects(prefix: str) -> list[str]:
    """Removes the containers, volumes and networks of projects named `<prefix>-<pid>[-...]` whose test process
    is gone (a run killed before its teardown): a container with a restart policy comes back with dockerd and
    holds its image and volumes otherwise. Returns the project names removed."""
    labels = docker("ps", "--all", "--filter", "label=com.docker.compose.project",
                    "--format", '{{.Label "com.docker.compose.project"}}').stdout.split()
    labels += docker("volume", "ls", "--filter", "label=com.docker.compose.project",
                     "--format", '{{.Label "com.docker.compose.project"}}').stdout.split()
    stale = sorted({name for name in labels if (match := re.fullmatch(rf"{re.escape(prefix)}-(\d+)(-.*)?", name))
                    and not _alive(int(match.group(1)))})
    for name in stale:
        label = f"label=com.docker.compose.project={name}"
        for kind, listing in (("container", ("ps", "--all", "--quiet")), ("volume", ("volume", "ls", "--quiet")),
                              ("network", ("network", "ls", "--quiet"))):
            ids = docker(*listing, "--filter", label).stdout.split()
            if ids:
                docker(kind, "rm", *(["--force"] if kind == "container" else []), *ids, check=False)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call, as a deployment's clients do."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details.method, details.timeout, tuple(details.metadata or ()) + self._metadata,
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)
