"""What every real process a test starts has in common: a Popen, an address it serves on, a log file."""
from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]


def tree_pythonpath(tree: Path) -> str:
    """PYTHONPATH for a child running another checkout: that tree and its stubs first, then whatever else the
    parent's PYTHONPATH holds (packages installed beside it, as on a GPU machine) except this checkout's folders."""
    ours = {str(REPO_ROOT), str(REPO_ROOT / "proto")}
    kept = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in ours]
    return os.pathsep.join([str(tree), str(tree / "proto"), *kept])


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
