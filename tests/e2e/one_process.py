"""Start `python -m kvboost_server` (gateway and service in one process) on loopback ports and wait until it
serves HTTP."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import pick_free_port, wait_for
from tests.e2e.child_process import ChildProcess, tree_pythonpath

REPO_ROOT = Path(__file__).resolve().parents[2]


def start_one_process(model: str, daemon_address: str, log_path: Path, service_flags: tuple[str, ...] = (),
                      gateway_flags: tuple[str, ...] = (), timeout_s: float = 120.0, device: str = "cpu",
                      tree: Path | None = None) -> tuple[ChildProcess, str]:
    """(the server, whose address is its HTTP base URL; its gRPC address). No KVBOOST_* variable leaks in.
    tree: run another checkout's server (a benchmark's baseline), from its folder with its packages first."""
    grpc_port, http_port = pick_free_port(), pick_free_port()
    command = [sys.executable, "-m", "kvboost_server", "--model", model, "--cache-addr", daemon_address,
               "--listen", f"127.0.0.1:{grpc_port}", "--device", device, *service_flags,
               "--gateway", "--listen", f"127.0.0.1:{http_port}", *gateway_flags]
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVBOOST_")}
    if tree is not None:
        env["PYTHONPATH"] = tree_pythonpath(tree)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, cwd=tree or REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                   env=env)
    server = ChildProcess(process, f"http://127.0.0.1:{http_port}", log_path)

    def answering() -> bool:
        assert process.poll() is None, f"kvboost_server exited with {process.returncode}:\n{server.log()}"
        try:
            return httpx.get(f"{server.address}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(answering, "kvboost_server to serve HTTP", timeout_s=timeout_s)
    return server, f"127.0.0.1:{grpc_port}"
