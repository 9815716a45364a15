"""Start `python -m http_gateway` as a real process on a loopback port and wait until it answers HTTP."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from tests.e2e.child_process import ChildProcess

REPO_ROOT = Path(__file__).resolve().parents[2]


class GatewayProcess(ChildProcess):
    @property
    def base_url(self) -> str:  # http(s)://127.0.0.1:PORT
        return self.address


def launch_gateway(service_addr: str, port: int, log_path: Path, *extra_args: str) -> GatewayProcess:
    """Starts the gateway without waiting; no KVBOOST_* variable of the test run leaks in."""
    command = [sys.executable, "-m", "http_gateway", "--listen", f"127.0.0.1:{port}", "--service-addr", service_addr,
               *extra_args]
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVBOOST_")}
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    scheme = "https" if "--https-cert" in extra_args else "http"
    return GatewayProcess(process, f"{scheme}://127.0.0.1:{port}", log_path)


def wait_until_answering(gateway: GatewayProcess, timeout_s: float = 60.0) -> None:
    """Until GET /health gets any HTTP answer (the service behind it may be down on purpose)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if gateway.process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {gateway.process.returncode}:\n{gateway.log()}")
        try:
            httpx.get(f"{gateway.base_url}/health", timeout=5.0, verify=False)  # any answer; tests check TLS
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                gateway.terminate()
                raise RuntimeError(f"the gateway does not answer after {timeout_s} s:\n{gateway.log()}") from None
            time.sleep(0.05)


@contextmanager
def running_gateways(*launches: tuple) -> Iterator[list[GatewayProcess]]:
    """Starts several gateways at once ((service_addr, port, log_path, *flags) each); always stops them."""
    gateways = []
    try:
        for launch in launches:
            gateways.append(launch_gateway(*launch))
        for gateway in gateways:
            wait_until_answering(gateway)
        yield gateways
    finally:
        for gateway in gateways:
            if gateway.process.poll() is None:
                gateway.terminate()
