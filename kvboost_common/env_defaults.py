"""Flag defaults from KVBOOST_<NAME> environment variables, typed like the built-in default they replace, and
renamed flags whose old names still work."""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Mapping, TypeVar

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


def add_renamed_flags(parser: argparse.ArgumentParser, renamed: Mapping[str, str], default: Callable[..., Any]) -> None:
    """Parses each old flag of `renamed` (old dest -> new dest, whose flag the parser has already) and its KVBOOST_
    variable, hidden from --help, so a deployment that still names one keeps starting (see apply_renamed_flags)."""
    for old, new in renamed.items():
        kind = next(action.type for action in parser._actions if action.dest == new)
        parser.add_argument("--" + old.replace("_", "-"), dest=old, type=kind, default=default(old.upper(), None, kind),
                            help=argparse.SUPPRESS)


def apply_renamed_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, renamed: Mapping[str, str],
                        defaults: object) -> None:
    """Moves each old flag's value (flag or variable) to its new name, with a warning, where the new one is left at
    its default (`defaults`' attribute); both set to different values is a usage error (which was meant is not
    guessed). Removes the old names from args."""
    for old, new in renamed.items():
        value = vars(args).pop(old)
        if value is None:
            continue
        was = f"--{old.replace('_', '-')} (KVBOOST_{old.upper()})"
        now = f"--{new.replace('_', '-')} (KVBOOST_{new.upper()})"
        if getattr(args, new) not in (getattr(defaults, new), value):
            parser.error(f"{was} is the old name of {now}: set only the new one")
        logging.getLogger(__name__).warning("%s was renamed %s; the old name still works for now", was, now)
        setattr(args, new, value)
