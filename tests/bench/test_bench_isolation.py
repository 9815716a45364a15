"""bench_isolation's report says what the measured ratio is, not what it is hoped to be."""
from __future__ import annotations

import pytest

from bench.bench_isolation import describe_b_ratio


@pytest.mark.parametrize("ratio, words", [
    (1.0, "about 1"), (0.95, "about 1"), (1.2, "about 1"),
    (0.3, "faster than its baseline"), (0.79, "faster than its baseline"),
    (1.3, "slower than its baseline"),
])
def test_the_b_ratio_is_described_as_measured(ratio, words):
    assert words in describe_b_ratio(ratio)
    if words != "about 1":
        assert "about 1" not in describe_b_ratio(ratio)
