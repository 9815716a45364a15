"""KVBOOST_<NAME> defaults: typed like the built-in default, booleans by word, bad values stop with a message."""
from __future__ import annotations

import pytest

from kvboost_common.env_defaults import env_default_reader


def test_unset_keeps_the_built_in_default():
    assert env_default_reader({})("MAX_QUEUE", 64) == 64


@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("Yes", True), (" on ", True), ("0", False), ("no", False)])
def test_booleans_read_words(raw, expected):
    assert env_default_reader({"KVBOOST_DEBUG": raw})("DEBUG", not expected) is expected


def test_values_take_the_type_of_the_default():
    default = env_default_reader({"KVBOOST_MAX_QUEUE": "8", "KVBOOST_RATIO": "0.25", "KVBOOST_LISTEN": "unix:/s"})
    assert default("MAX_QUEUE", 64) == 8 and default("RATIO", 1.0) == 0.25 and default("LISTEN", "") == "unix:/s"


def test_a_value_of_the_wrong_type_names_the_variable():
    with pytest.raises(SystemExit, match=r"KVBOOST_MAX_QUEUE='lots' is not a valid int"):
        env_default_reader({"KVBOOST_MAX_QUEUE": "lots"})("MAX_QUEUE", 64)


def test_a_default_of_none_converts_the_variable_to_the_kind_given() -> None:
    default = env_default_reader({"KVBOOST_GUARD": "2e-4", "KVBOOST_BAD": "x"})
    assert default("GUARD", None, float) == 2e-4
    assert default("UNSET", None, float) is None
    with pytest.raises(SystemExit, match="KVBOOST_BAD='x' is not a valid float"):
        default("BAD", None, float)
