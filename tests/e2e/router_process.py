"""Start `python -m router` as a real process in front of real replicas, and read its /metrics."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import grpc

from client.healthcheck import wait_until_serving
from kvboost.v1 import inference_pb2_grpc
from tests.e2e.child_process import ChildProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICE_NAME = "kvboost.v1.InferenceService"
STATS_INTERVAL_S = 0.2  # the routers' --stats-interval: replicas' health and load are read this often


class RouterProcess(ChildProcess):
    metrics_port: int = 0

    @contextmanager
    def stub(self) -> Iterator[inference_pb2_grpc.InferenceServiceStub]:
        with grpc.insecure_channel(self.address) as channel:
            yield inference_pb2_grpc.InferenceServiceStub(channel)

    def metric(self, name: str, replica: str | None = None) -> float:
        """The value of `name` on the router's /metrics: for one replica (its service address), or unlabelled."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
        labels = "" if replica is None else rf'\{{replica="{re.escape(replica)}"\}}'
        found = re.search(rf'^{re.escape(name)}(?:_total)?{labels} (\S+)$', text, re.M)
        assert found, f"{name} for {replica} is not on /metrics:\n{text}"
        return float(found.group(1))


def router_command(replicas: Sequence[tuple[str, str]], port: int, *extra_args: str) -> list[str]:
    flags = [f"--replica={service}={daemon}" for service, daemon in replicas]
    return [sys.executable, "-m", "router", "--listen", f"127.0.0.1:{port}", *flags, *extra_args]


def run_router(replicas: Sequence[tuple[str, str]], port: int, *extra_args: str,
               timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """Runs a router that is expected to refuse to start; returns its exit status and output."""
    return subprocess.run(router_command(replicas, port, *extra_args), cwd=REPO_ROOT, env=_environment(),
                          capture_output=True, text=True, timeout=timeout_s)


def start_router(replicas: Sequence[tuple[str, str]], port: int, metrics_port: int, log_path: Path,
                 *extra_args: str, timeout_s: float = 60.0) -> RouterProcess:
    """Starts the router on 127.0.0.1:port with /metrics on metrics_port; returns once health says SERVING."""
    command = router_command(replicas, port, "--metrics-port", str(metrics_port),
                             "--stats-interval", str(STATS_INTERVAL_S), *extra_args)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                   env=_environment())
    router = RouterProcess(process, f"127.0.0.1:{port}", log_path)
    router.metrics_port = metrics_port
    status = wait_until_serving(router.address, timeout_s, SERVICE_NAME, is_alive=lambda: process.poll() is None)
    if status != "SERVING":
        if process.poll() is None:
            router.kill()
        raise RuntimeError(f"router not SERVING (health {status}, exit {process.returncode}):\n{router.log()}")
    return router


def _environment() -> dict[str, str]:
    """No KVBOOST_* variable of the test run leaks in: the flags say everything."""
    return {name: value for name, value in os.environ.items() if not name.startswith("KVBOOST_")}
