"""A short run of bench/load.py (4 clients, 6 s) against its own stack with the tiny model: 0 errors, budget held."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.daemon_process import REPO_ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CLIENTS = 4
DURATION_S = 6


def test_short_load_has_no_errors_and_respects_the_budget(tmp_path) -> None:
    report_path = tmp_path / "load.json"
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVBOOST_")}
    # A 2 MiB budget: the clients' write-backs overflow it, so eviction runs during the load.
    result = subprocess.run(
        [sys.executable, "bench/load.py", "--model", "tiny", "--chunk-size", "32", "--max-bytes", "2M",
         "--clients", str(CLIENTS), "--duration", str(DURATION_S), "--max-new-tokens", "4", "--json", str(report_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=200)
    print(result.stdout)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    report = json.loads(report_path.read_text())
    assert report["errors"] == 0, report["error_messages"]
    assert report["requests"] >= CLIENTS, "every client completed at least one request"
    assert report["budget_samples"] > 0 and not report["budget_exceeded"]
    assert report["max_stored_bytes_seen"] <= report["budget_bytes"] == 2 << 20
    assert report["ttft_ms_p50"] > 0 and report["ttft_ms_p99"] >= report["ttft_ms_p50"]
    assert report["mean_kv_reuse_ratio"] > 0, "the shared system prompt is reused"
    assert report["daemon_rss_after_bytes"] and report["lmdb_bytes_after"]
