"""Start the real vllm-router (PyPI `vllm-router`, a Rust binary in a wheel) in front of replicas' gateways."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import pick_free_port
from tests.e2e.child_process import ChildProcess


def vllm_router_binary() -> str | None:
    """The vllm-router console script of this interpreter's environment (None: not installed)."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


@dataclass(frozen=True)
class EventSource:
    """A replica as the router sees it: its HTTP URL and its KV-event sockets."""

    worker_url: str
    endpoint: str  # tcp://127.0.0.1:PORT
    replay_endpoint: str


def start_vllm_router(sources: list[EventSource], log_path: Path, policy: str = "kv_aware", block_size: int = 16,
                      model: str = "tiny", port: int | None = None, timeout_s: float = 30.0) -> ChildProcess:
    """The router on 127.0.0.1; returns once it answers /health."""
    port = port or pick_free_port()
    command = [vllm_router_binary(), "--worker-urls", *[source.worker_url for source in sources],
               "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(pick_free_port()),
               "--policy", policy, "--log-level", "debug", "--disable-retries", "--disable-circuit-breaker"]
    if policy == "kv_aware":
        for source in sources:
            command += ["--kv-event-source", f"{source.worker_url}={source.endpoint}",
                        "--kv-event-replay-source", f"{source.worker_url}={source.replay_endpoint}"]
        command += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    router = ChildProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{router.address}/health", timeout=2.0).status_code == 200:
                return router
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            router.terminate()
            raise RuntimeError(f"vllm-router does not answer after {timeout_s} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)
