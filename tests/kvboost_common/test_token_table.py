"""kvboost_common.auth.TokenTableInterceptor: which authorization values name which principal."""
from __future__ import annotations

from contextvars import ContextVar

import pytest

from kvboost_common.auth import TokenTableInterceptor

caller: ContextVar[str | None] = ContextVar("caller", default=None)
TABLE = TokenTableInterceptor({"alice-token": "alice", "ops-token": "ops"}, caller)


def test_a_known_bearer_token_names_its_principal() -> None:
    assert TABLE.principal_for("Bearer alice-token") == "alice"
    assert TABLE.principal_for("Bearer ops-token") == "ops"


@pytest.mark.parametrize("authorization", [
    None, "", "Bearer", "Bearer ", "alice-token", "bearer alice-token", "Basic alice-token", "Bearer  alice-token",
    "Bearer alice-token ", "Bearer alice-tokenX", "Bearer alice-toke", "Bearer \udcff", "Bearer ALICE-TOKEN",
])
def test_anything_else_names_no_one(authorization) -> None:
    assert TABLE.principal_for(authorization) is None
