"""Shared fixtures: tiny seeded random-weight models, the real SmolLM2, free ports."""
from __future__ import annotations

import socket

import pytest

from tests.factories import build_tiny_model, load_smollm2


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small-batch forwards gain little from a second thread and lose a lot when cores are shared.
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_llama():
    """(model, tokenizer) of a 2-layer random Llama with a byte-level tokenizer."""
    return build_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    return build_tiny_model("qwen2")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, path) of the real SmolLM2-135M-Instruct on CPU fp32."""
    return load_smollm2()


@pytest.fixture()
def free_port() -> int:
    return pick_free_port()


def pick_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
