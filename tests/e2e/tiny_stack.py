"""A cache daemon and an inference service over a tiny random model saved in a test's folder, as real processes."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tests.conftest import pick_free_port
from tests.e2e.daemon_process import DaemonProcess, start_daemon
from tests.e2e.service_process import ServiceProcess, running_service
from tests.e2e.stack_process import save_tiny_model


@contextmanager
def tiny_daemon_and_service(folder: Path, *service_flags: str) -> Iterator[tuple[DaemonProcess, ServiceProcess, Path]]:
    """(daemon, service, model folder); the service gets service_flags; both stop afterwards."""
    model_dir = save_tiny_model(folder / "tiny-model")
    daemon = start_daemon(folder / "lmdb", pick_free_port())
    try:
        with running_service(str(model_dir), daemon.address, pick_free_port(), folder / "service.log",
                             *service_flags) as service:
            yield daemon, service, model_dir
    finally:
        daemon.terminate()
