"""Start `python -m cache_daemon` as a real process on a loopback port and wait until it serves."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.daemon_support import shared_l2_key_file
from tests.e2e.child_process import ChildProcess, tree_pythonpath

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_SERVICE = "kvboost.v1.CacheService"
# Retry the connection every 50 ms while the daemon starts, not after gRPC's default 1 s backoff.
_FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 200)]


class DaemonProcess(ChildProcess):
    def wait(self, timeout_s: float = 30.0) -> int:
        return self.process.wait(timeout=timeout_s)


def start_daemon(data_dir: Path, port: int | str, *extra_args: str, tls_root_cert: bytes | None = None,
                 timeout_s: float = 30.0, env: dict[str, str] | None = None, tree: Path | None = None) -> DaemonProcess:
    """Starts the daemon on 127.0.0.1:port (or a unix:PATH address) with data_dir and extra_args; returns once
    health says SERVING for the cache service. The daemon's output goes to <data_dir>.log. With --l2 and
    no --l2-key-file, the L2 key file beside data_dir (created once) is passed. tree: run the daemon of another
    checkout (a benchmark's baseline), from its folder with its packages first."""
    data_dir = Path(data_dir)
    if "--l2" in extra_args and "--l2-key-file" not in extra_args:  # daemons started side by side share one key
        extra_args = (*extra_args, "--l2-key-file", str(shared_l2_key_file(data_dir.parent)))
    log_path = data_dir.with_name(data_dir.name + ".log")
    address = port if isinstance(port, str) else f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "cache_daemon", "--data-dir", str(data_dir), "--listen", address, *extra_args]
    env = {**os.environ, **(env or {})}
    if tree is not None:
        env["PYTHONPATH"] = tree_pythonpath(tree)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, cwd=tree or REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    daemon = DaemonProcess(process, address, log_path)
    try:
        _wait_until_serving(daemon, tls_root_cert, timeout_s)
    except BaseException:
        if process.poll() is None:
            daemon.kill()
        raise
    return daemon


def _wait_until_serving(daemon: DaemonProcess, tls_root_cert: bytes | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    if tls_root_cert is None:
        channel = grpc.insecure_channel(daemon.address, options=_FAST_RECONNECT)
    else:
        channel = grpc.secure_channel(daemon.address, grpc.ssl_channel_credentials(tls_root_cert),
                                      options=_FAST_RECONNECT)
    with channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if daemon.process.poll() is not None:
                raise RuntimeError(f"cache daemon exited with {daemon.process.returncode}:\n{daemon.log()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"cache daemon not SERVING after {timeout_s}s:\n{daemon.log()}")
            try:
                # wait_for_ready holds the call until the port accepts connections; Watch then
                # streams every status change, so nothing polls in a loop.
                replies = health.Watch(health_pb2.HealthCheckRequest(service=CACHE_SERVICE),
                                       timeout=min(remaining, 1.0), wait_for_ready=True)
                for reply in replies:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        replies.cancel()
                        return
            except grpc.RpcError:
                continue
