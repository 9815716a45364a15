"""Flag defaults from KVBOOST_<NAME> environment variables, typed like the built-in default they replace."""
from __future__ import annotations

from typing import Callable, Mapping, TypeVar

T = TypeVar("T")
TRUE_WORDS = ("1", "true", "yes", "on")


def env_default_reader(environ: Mapping[str, str]) -> Callable[[str, T], T]:
    """`default(NAME, value)`: KVBOOST_NAME converted to value's type when it is set, else value.
    Booleans accept 1/true/yes/on; a value that does not convert stops the program with a message naming it."""

    def default(name: str, value: T) -> T:
        raw = environ.get(f"KVBOOST_{name}")
        if raw is None:
            return value
        if isinstance(value, bool):
            return raw.strip().lower() in TRUE_WORDS  # type: ignore[return-value]
        try:
            return type(value)(raw)  # type: ignore[call-arg]
        except ValueError:
            raise SystemExit(f"KVBOOST_{name}={raw!r} is not a valid {type(value).__name__}") from None

    return default
