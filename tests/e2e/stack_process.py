"""The local stack (client.stack) as the e2e tests run it: real daemon and service processes, a tiny model."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import pick_free_port

ROOT = Path(__file__).resolve().parents[2]
STACK_TIMEOUT_S = 180


@dataclass(slots=True, frozen=True)
class StackPaths:
    run_dir: Path
    address: str
    daemon_address: str
    gateway_address: str


def save_tiny_model(folder: Path, kind: str = "llama") -> Path:
    """A 2-layer random model (tests.factories kinds) with the byte tokenizer, saved where the service can load
    it by path."""
    from tests.factories import build_tiny_model

    model, tokenizer = build_tiny_model(kind)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_ids(model_dir: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """Plain transformers greedy output for the prompt alone, loaded fresh from the saved model: the ground truth."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    input_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens)
    return output[0, input_ids.shape[1]:].tolist()


def stack_command(paths: StackPaths, action: str, *extra: str) -> subprocess.CompletedProcess:
    """Runs `python -m client.stack ACTION` the way `make up` does, with no KVBOOST_* variables leaking in."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVBOOST_")}
    command = [sys.executable, "-m", "client.stack", action, "--run-dir", str(paths.run_dir),
               "--address", paths.address, "--daemon-address", paths.daemon_address,
               "--gateway-address", paths.gateway_address, *extra]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=STACK_TIMEOUT_S + 60)


@contextmanager
def running_stack(run_dir: Path, model_dir: Path, *extra: str):
    """Starts the stack on free loopback ports (extra: more `client.stack up` flags); yields its StackPaths; always
    stops it."""
    paths = StackPaths(run_dir, *(f"127.0.0.1:{pick_free_port()}" for _ in range(3)))
    try:
        started = stack_command(paths, "up", "--model", str(model_dir), "--timeout", str(STACK_TIMEOUT_S), *extra)
        assert started.returncode == 0, f"stack up failed:\n{started.stdout}\n{started.stderr}"
        yield paths
    finally:
        stack_command(paths, "down")
