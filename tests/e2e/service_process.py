"""Start `python -m inference_service` as a real process on a loopback port and wait until it serves."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc

from client.healthcheck import wait_until_serving
from kvboost.v1 import inference_pb2 as pb
from kvboost.v1 import inference_pb2_grpc
from tests.e2e.child_process import ChildProcess, tree_pythonpath

REPO_ROOT = Path(__file__).resolve().parents[2]


class ServiceProcess(ChildProcess):
    """SIGTERM flushes pending write-backs before the service exits."""

    @contextmanager
    def stub(self) -> Iterator[inference_pb2_grpc.InferenceServiceStub]:
        with grpc.insecure_channel(self.address) as channel:
            yield inference_pb2_grpc.InferenceServiceStub(channel)


def start_service(model: str, cache_addr: str, port: int, log_path: Path, *extra_args: str,
                  timeout_s: float = 60.0, tree: Path | None = None) -> ServiceProcess:
    """Starts the service on 127.0.0.1:port (CPU) and returns once health says SERVING.

    No KVBOOST_* variable of the test run leaks in: the flags say everything. tree: run the code of another
    checkout (a git worktree of an earlier commit, for a benchmark's side-by-side run) instead of this one.
    """
    address = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "inference_service", "--model", model, "--cache-addr", cache_addr,
               "--listen", address, "--device", "cpu", *extra_args]
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVBOOST_")}
    if tree is not None:  # its own packages and stubs first, ahead of this checkout's editable install
        env["PYTHONPATH"] = tree_pythonpath(tree)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, cwd=tree or REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                   env=env)
    service = ServiceProcess(process, address, log_path)
    status = wait_until_serving(address, timeout_s, is_alive=lambda: process.poll() is None)
    if status != "SERVING":
        if process.poll() is None:
            service.terminate()
        raise RuntimeError(f"inference service not SERVING (health {status}, exit {process.returncode}):\n{service.log()}")
    return service


@contextmanager
def running_service(model: str, cache_addr: str, port: int, log_path: Path, *extra_args: str,
                    timeout_s: float = 60.0) -> Iterator[ServiceProcess]:
    service = start_service(model, cache_addr, port, log_path, *extra_args, timeout_s=timeout_s)
    try:
        yield service
    finally:
        if service.process.poll() is None:
            status = service.terminate()
            assert status == 0, f"the service exited with {status} on SIGTERM:\n{service.log()}"


def generate(stub: inference_pb2_grpc.InferenceServiceStub, prompt: str, timeout_s: float = 60.0,
             **fields) -> tuple[list[pb.GenerateEvent], pb.GenerationResult]:
    """All events of one Generate call and the final result."""
    events = list(stub.Generate(pb.GenerateRequest(prompt=prompt, **fields), timeout=timeout_s))
    assert events and events[-1].HasField("result"), "the stream must end with a result"
    return events, events[-1].result
