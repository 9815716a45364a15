"""The Node.js client (client/node) against the live stack: loads the .proto files, calls Warm and Generate."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.stack_process import ROOT, running_stack, save_tiny_model

pytestmark = pytest.mark.e2e

NODE_DIR = ROOT / "client" / "node"
DOCUMENT = "Ferries leave Castel Verde every forty minutes between seven and seven. " * 6  # 438 bytes


@pytest.fixture(scope="module")
def node_client(tmp_path_factory) -> Path:
    """client.js with its locked dependencies installed (npm ci) in a copy laid out like the repository."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not on PATH: the Node client cannot run here")
    copy = tmp_path_factory.mktemp("node-client")
    for name in ("package.json", "package-lock.json", "client.js"):
        (copy / "client" / "node").mkdir(parents=True, exist_ok=True)
        shutil.copy(NODE_DIR / name, copy / "client" / "node" / name)
    shutil.copytree(ROOT / "proto" / "kvboost", copy / "proto" / "kvboost",
                    ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    installed = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=copy / "client" / "node",
                               capture_output=True, text=True, timeout=300)
    # With node present a failed install is a CI problem to see, not a skip. A machine that knowingly has no
    # registry says so: KVBOOST_NO_NPM_REGISTRY=<why> turns the failure into a skip with that reason.
    if installed.returncode != 0:
        offline = os.environ.get("KVBOOST_NO_NPM_REGISTRY")
        if offline:
            pytest.skip(f"npm ci failed and KVBOOST_NO_NPM_REGISTRY says why: {offline}")
        pytest.fail(f"npm ci could not install the locked dependencies (exit {installed.returncode}):\n"
                    f"{installed.stderr[-2000:]}", pytrace=False)
    return copy / "client" / "node" / "client.js"


def test_node_client_warms_then_generates_with_reuse(tmp_path, node_client) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny-model")
    document = tmp_path / "document.txt"
    document.write_text(DOCUMENT)
    with running_stack(tmp_path / "run", model_dir) as paths:
        completed = subprocess.run(
            ["node", str(node_client), "--address", paths.address, "--warm", str(document),
             "--prefix-file", str(document), "--mode", "prefix_cache", "--max-new-tokens", "4", "--json",
             "When does the first ferry leave?"],
            capture_output=True, text=True, timeout=120,
        )
    assert completed.returncode == 0, completed.stderr
    warm_line, result_line = completed.stdout.splitlines()
    warmed, result = json.loads(warm_line), json.loads(result_line)
    # Whole chunks and the document's tail as a partial chunk; the question continues the document.
    assert (warmed["chunks_stored"], warmed["token_count"]) == (len(DOCUMENT) // 128 + 1, len(DOCUMENT))
    assert result["mode"] == "PREFIX_CACHE"
    assert result["cached_tokens"] == len(DOCUMENT)
    assert result["generated_tokens"] == 4 and len(result["output_token_ids"]) == 4
    assert set(result) >= {"output_text", "ttft_ms", "kv_reuse_ratio", "prompt_tokens", "finish_reason"}


def test_node_client_reports_an_unreachable_service(node_client) -> None:
    from tests.conftest import pick_free_port

    completed = subprocess.run(["node", str(node_client), "--address", f"127.0.0.1:{pick_free_port()}",
                                "--timeout", "2", "hello"], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 1
    assert completed.stderr.startswith("kvboost-node: error (")
