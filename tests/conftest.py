"""Shared fixtures: tiny seeded random-weight models, the real SmolLM2, free ports."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from inference_service import mkl_dispatch

# Before torch is imported: the references (plain model.generate) run under the dispatch a service started
# with the defaults runs under (KVBOOST_MKL_DISPATCH, else auto), so every identity test compares like with like.
MKL_DISPATCH = mkl_dispatch.apply()

from tests.factories import build_tiny_model, load_smollm2


# -- `make test` runs the suite on pytest-xdist workers (-n, --dist loadfile: a module stays on one worker) --------

def xdist_workers(config) -> int:
    """How many xdist workers run the suite (1: no xdist). Read from the worker's input, which xdist hands over
    before collection; its PYTEST_XDIST_WORKER_COUNT variable is set only after this file is imported."""
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput["workercount"]) if workerinput else 1


def module_weight(item) -> int:
    """The order modules are handed to xdist workers in: the real-model modules first (the longest: the 200-prompt
    sweep, the identity tests, the compose engine), then those that start processes, then the rest, which fill the
    gaps at the end instead of leaving one worker alone with a long module."""
    return 0 if "slow" in item.keywords else 1 if "e2e" in item.keywords else 2


def pytest_configure(config):
    workers = xdist_workers(config)
    if workers > 1:  # each worker's torch gets its share of the cores, so two workers' forwards do not fight
        import torch

        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        # ... and so do the processes tests start (services, gateways, the compose stack's replicas, through
        # KVBOOST_THREADS in ComposeProject): an OpenMP team per process, each as wide as the machine, on cores the
        # other worker also uses, waits on its descheduled threads. In CI a compose test beside the 200-prompt
        # sweep ran 4.8x its time alone, and a Lookup ran past its deadline.
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


def pytest_collection_modifyitems(config, items):
    import torch

    if xdist_workers(config) > 1:  # every worker sorts the same way, so xdist sees one collection
        weight = {}
        for item in items:
            weight[item.path] = min(weight.get(item.path, 2), module_weight(item))
        items.sort(key=lambda item: weight[item.path])  # stable: a module's tests keep their order
    if torch.cuda.is_available() or os.environ.get("KVBOOST_TEST_DEVICE") == "cpu":  # cpu: tests/gpu/ dry run
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# -- the fast suite (-m "not slow and not e2e") never loads the real model ---------------------------------

REAL_MODEL_MARKS = ("slow", "e2e")


def is_fast(item) -> bool:
    return not any(mark in item.keywords for mark in REAL_MODEL_MARKS)


def pytest_runtest_setup(item):
    # Before any fixture is set up (conftest hooks run before pytest's own): a session-scoped smollm2 would
    # otherwise load before a function-scoped guard could see it.
    for fixture in ("smollm2", "smollm2_reference"):
        if is_fast(item) and fixture in item.fixturenames:
            pytest.fail(f"{item.nodeid} uses the real SmolLM2 ({fixture} fixture): mark it slow", pytrace=False)


@pytest.fixture(autouse=True)
def real_model_guard(request, monkeypatch):
    """In a fast test, any way to the real model's weights fails the test instead of loading them."""
    if not is_fast(request.node):
        yield
        return
    from inference_service.model import weights
    from tests import factories

    models_dir = weights.model_cache_dir().resolve()

    def refuse(what: str):
        def refused(*args, **kwargs):
            pytest.fail(f"{request.node.nodeid} loads the real model ({what}) but is not marked slow or e2e",
                        pytrace=False)
        return refused

    resolve = weights.resolve_model_path

    def resolve_guarded(name_or_path: str) -> str:
        # Any catalogue model (by name, by its GGUF or by its converted folder) lives under the model cache.
        if name_or_path and models_dir in Path(name_or_path).expanduser().resolve().parents:
            refuse(f"a converted folder under {models_dir}")()
        resolved = resolve(name_or_path)
        if models_dir in Path(resolved).resolve().parents:
            refuse(f"{resolved}")()
        return resolved

    monkeypatch.setattr(weights, "prepare_default_model", refuse("prepare_default_model"))
    monkeypatch.setattr(weights, "prepare_model", refuse("prepare_model"))
    monkeypatch.setattr(weights, "resolve_model_path", resolve_guarded)
    monkeypatch.setattr(factories, "load_smollm2", refuse("load_smollm2"))
    yield


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


@pytest.fixture(scope="module")
def smollm2_reference():
    """Plain model.generate on the real SmolLM2 in a process beside this one (tests/reference_process.py), so
    a test's references compute while its engine runs; one torch thread, like the tests that use it. Per
    module: the child holds a second copy of the model only while a module uses it."""
    from tests.reference_process import ReferenceProcess

    process = ReferenceProcess(MKL_DISPATCH.applied)
    try:
        yield process
    finally:
        process.close()


@pytest.fixture()
def free_port() -> int:
    return pick_free_port()


def pick_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, what: str = "the condition", timeout_s: float = 20.0, interval_s: float = 0.05):
    """Polls `condition` until it returns something truthy, and returns that; fails the test naming `what`
    when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)
    return value
