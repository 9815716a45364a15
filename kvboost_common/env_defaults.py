"""Flag defaults from KVBOOST_<NAME> environment variables, typed like the built-in default they replace."""
from __future__ import annotations

from typing import Callable, Mapping, TypeVar

T = TypeVar("T")
TRUE_WORDS = ("1", "true", "yes", "on")


def env_default_reader(environ: Mapping[str, str]) -> Callable[..., T]:
    """`default(NAME, value, kind=None)`: KVBOOST_NAME converted to `kind` (else value's type) when it is set,
    else value (`kind` for a default of None). Booleans accept 1/true/yes/on; a value that does not convert
    stops the program with a message naming it."""

    def default(name: str, value: T, kind: Callable[[str], T] | None = None) -> T:
        raw = environ.get(f"KVBOOST_{name}")
        if raw is None:
            return value
        if isinstance(value, bool):
            return raw.strip().lower() in TRUE_WORDS  # type: ignore[return-value]
        convert = kind or type(value)
        try:
            return convert(raw)  # type: ignore[call-arg]
        except ValueError:
            raise SystemExit(f"KVBOOST_{name}={raw!r} is not a valid {convert.__name__}") from None

    return default
