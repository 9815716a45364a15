"""What every real process a test starts has in common: a Popen, an address it serves on, a log file."""
from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ChildProcess:
    process: subprocess.Popen
    address: str  # host:port, or the base URL for HTTP
    log_path: Path

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM: graceful shutdown; SIGKILL when it does not exit in time."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=timeout_s)

    def kill(self) -> int:
        """SIGKILL: no flush, no sync (what a crash does)."""
        self.process.send_signal(signal.SIGKILL)
        return self.process.wait(timeout=30.0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
