"""The fast suite's guard: a test not marked slow or e2e that reaches for the real SmolLM2 fails."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests import conftest, factories


def test_loading_the_default_model_fails_a_fast_test() -> None:
    from inference_service.model.loading import load_model
    from inference_service.model.weights import DEFAULT_MODEL, model_cache_dir

    with pytest.raises(pytest.fail.Exception, match="loads the real model"):
        load_model(DEFAULT_MODEL)
    with pytest.raises(pytest.fail.Exception, match="loads the real model"):
        load_model(str(model_cache_dir() / DEFAULT_MODEL))  # its converted folder, by path
    with pytest.raises(pytest.fail.Exception, match="loads the real model"):
        factories.load_smollm2()


def test_the_smollm2_fixture_fails_a_fast_test_before_it_loads() -> None:
    fast = SimpleNamespace(keywords={}, fixturenames=["smollm2"], nodeid="tests/x.py::test_y")
    with pytest.raises(pytest.fail.Exception, match="mark it slow"):
        conftest.pytest_runtest_setup(fast)
    fast_reference = SimpleNamespace(keywords={}, fixturenames=["smollm2_reference"], nodeid="tests/x.py::test_z")
    with pytest.raises(pytest.fail.Exception, match="smollm2_reference fixture"):
        conftest.pytest_runtest_setup(fast_reference)
    conftest.pytest_runtest_setup(SimpleNamespace(keywords={"slow": True}, fixturenames=["smollm2"], nodeid="s"))
    conftest.pytest_runtest_setup(SimpleNamespace(keywords={}, fixturenames=["tiny_llama"], nodeid="t"))


@pytest.mark.slow
def test_slow_tests_are_not_guarded(smollm2) -> None:
    model, _, _ = smollm2
    assert model.config.num_attention_heads == 3 * model.config.num_key_value_heads
